"""The README's quick start stays true: CI runs exactly its test command."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines() if line.strip()]


def test_quick_start_is_exactly_two_commands():
    assert len(quick_start_commands()) == 2


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert quick_start_commands()[1] in ci_lines


def test_the_names_the_readme_imports_exist():
    import mmidx

    text = (ROOT / "README.md").read_text()
    line = next(line for line in text.splitlines() if line.startswith("from mmidx import"))
    for name in line.removeprefix("from mmidx import").split(","):
        assert getattr(mmidx, name.strip()) is not None
