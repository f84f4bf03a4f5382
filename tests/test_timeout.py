"""The per-test timeout (pyproject.toml): a test stuck in C code that never returns to the interpreter, as a
kernel's nogil loop is, ends as a failure naming it under ``-n 2``, and the other tests still run."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

STUCK = textwrap.dedent("""
    import ctypes


    def test_stuck_in_c_with_every_signal_blocked():
        libc = ctypes.CDLL(None)  # ctypes releases the GIL, as the kernels' nogil loops do
        mask = ctypes.create_string_buffer(128)  # a sigset_t, every signal in it
        libc.sigfillset(mask)
        libc.sigsuspend(mask)  # waits for a signal it blocks: returns never, not even for SIGALRM


    def test_next_to_it():
        assert True
""")


def test_the_configured_timeout_method_ends_a_test_stuck_in_c_and_names_it(tmp_path):
    pytest.importorskip("xdist")
    (tmp_path / "test_stuck.py").write_text(STUCK)
    done = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "no:cacheprovider", "-n", "2", "--timeout", "5", "-q",
                           str(tmp_path / "test_stuck.py")], capture_output=True, text=True, timeout=240)
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "crashed while running 'test_stuck.py::test_stuck_in_c_with_every_signal_blocked'" in output, output
    assert "1 failed, 1 passed" in output, output
