"""tools/skipped_tests.py, with which .ci/run reruns the tests the quick start's fresh venv skipped: the node ids it
reads from a real pytest report select exactly the skipped tests, of every shape (parametrized with brackets and
spaces, in a class, a module skipped whole, a fixture's skip, a module marker)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FILES = {
    "test_a.py": '''
        import pytest

        @pytest.mark.parametrize("x", ["a b", "c[d]", "ok"])
        def test_p(x):
            if x != "ok":
                pytest.skip("no")

        class TestK:
            def test_m(self):
                pytest.skip("k")

        def test_ok():
            pass
    ''',
    "test_b.py": '''
        import pytest

        pytest.importorskip("a_module_no_one_installed")

        def test_x():
            pass
    ''',
    "test_c.py": '''
        import pytest

        pytestmark = pytest.mark.skipif(True, reason="no browser")

        def test_y():
            pass
    ''',
    "conftest.py": '''
        import pytest

        @pytest.fixture(params=["u", "v"])
        def kernel(request):
            if request.param == "v":
                pytest.skip("this CPU lacks v")
            return request.param
    ''',
    "test_d.py": '''
        def test_z(kernel):
            pass
    ''',
}
SKIPPED = ["tests/test_a.py::test_p[a b]", "tests/test_a.py::test_p[c[d]]", "tests/test_a.py::TestK::test_m",
           "tests/test_b.py", "tests/test_c.py::test_y", "tests/test_d.py::test_z[v]"]


def pytest_in(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
                          cwd=folder, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    folder = tmp_path_factory.mktemp("project")
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "tests").mkdir()
    for name, text in FILES.items():
        (folder / "tests" / name).write_text(textwrap.dedent(text))
    result = pytest_in(folder, "-q", "--junitxml=report.xml", "tests")
    assert result.returncode == 0 and "3 passed, 6 skipped" in result.stdout, result.stdout + result.stderr
    return folder


def skipped_tests(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "tools" / "skipped_tests.py"), *args], capture_output=True,
                          text=True, timeout=60)


def test_it_lists_each_skipped_test_as_a_node_id_pytest_selects(project):
    listed = skipped_tests(str(project / "report.xml"), str(project))
    assert listed.returncode == 0, listed.stderr
    ids = listed.stdout.splitlines()
    assert sorted(ids) == sorted(SKIPPED)
    again = pytest_in(project, "-q", "-rs", *ids)
    assert again.returncode == 0 and again.stdout.splitlines()[-1].startswith("6 skipped"), again.stdout


def test_a_report_it_cannot_use_is_one_line_and_exit_status_1(project, tmp_path):
    (tmp_path / "broken.xml").write_text("<testsuites><testcase")
    (tmp_path / "elsewhere.xml").write_text('<testsuites><testcase classname="tests.test_gone" name="test_q">'
                                            '<skipped/></testcase></testsuites>')
    for report in ("broken.xml", "elsewhere.xml", "absent.xml"):
        result = skipped_tests(str(tmp_path / report), str(project))
        assert result.returncode == 1 and result.stdout == ""
        (line,) = result.stderr.splitlines()
        assert line.startswith(f"skipped_tests: {tmp_path / report}: ")


def test_a_run_that_skipped_nothing_prints_nothing(tmp_path):
    (tmp_path / "clean.xml").write_text('<testsuites><testsuite><testcase classname="tests.test_a" name="test_ok"/>'
                                        "</testsuite></testsuites>")
    result = skipped_tests(str(tmp_path / "clean.xml"), str(ROOT))
    assert result.returncode == 0 and result.stdout == ""
