"""Print the node ids of the tests a pytest run skipped, one a line, read from its JUnit XML report::

    python tools/skipped_tests.py REPORT.xml [ROOT]

``.ci/run`` reruns them (``python -m pytest ...ids``) once it has installed what the venv of the README's quick start
lacked (torchtitan, Chromium), so that every test runs somewhere without running the suite twice. ``ROOT`` is the
folder pytest ran in (default: this checkout): a report names a test by its module's dotted path (``tests.test_x``,
and any class after it) and its name; a module skipped whole (``pytest.importorskip`` at import) by its dotted path
alone. Exit status 1, with one line, for a report that cannot be read or names a test no file of ``ROOT`` holds.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def node_id(classname: str, name: str, root: Path) -> str:
    """The pytest node id of a report's test: the longest prefix of ``classname`` that is a module file under
    ``root``, then the classes after it, then ``name`` (a module skipped whole is ``classname=""``, ``name`` its
    dotted path)."""
    parts = classname.split(".") if classname else name.split(".")
    test = [name] if classname else []
    for end in range(len(parts), 0, -1):
        module = Path(*parts[:end]).with_suffix(".py")
        if (root / module).is_file():
            return "::".join([module.as_posix(), *parts[end:], *test])
    raise ValueError(f"no test module under {root} for {classname or name!r}")


def skipped(report: str | Path, root: Path) -> list[str]:
    """The node ids of the skipped tests of ``report``, in its order, each once."""
    ids = [node_id(case.get("classname", ""), case.get("name", ""), root)
           for case in ElementTree.parse(report).iter("testcase") if case.find("skipped") is not None]
    return list(dict.fromkeys(ids))


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    root = Path(argv[1]) if len(argv) == 2 else Path(__file__).resolve().parent.parent
    try:
        for test in skipped(argv[0], root):
            print(test)
    except (OSError, ElementTree.ParseError, ValueError) as error:
        print(f"skipped_tests: {argv[0]}: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
