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


def _blocks(language: str) -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [part.split("```", 1)[0] for part in text.split(f"```{language}\n")[1:]]


def test_the_python_example_runs_as_written_after_the_demo(demo, monkeypatch):
    """The README's Python runs unchanged on this CPU machine, in the folder where `mmidx demo` ran."""
    (block,) = _blocks("python")
    monkeypatch.chdir(Path(demo["workdir"]).parent)
    names = {}
    exec(compile(block, "README.md", "exec"), names)  # the README's own code
    assert names["step"] == 1 and names["checkpoint"]["data"] == {"packs_consumed": 2}
    assert set(names["data"]) >= {"sequence_length", "sample_lens", "packed_text_ids"}
    assert len(names["bounds"]) == 4 and names["tokens"].size == names["bounds"][-1]


def test_the_demo_output_shown_is_the_demos_in_its_folder(demo):
    """The README shows the demo's step lines and its ./mmidx-demo folder, as the command prints them."""
    block = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("```\n", 3)[2]
    lines = block.splitlines()
    assert lines[:len(demo["steps"])] == [line for line, _ in demo["steps"]]
    assert lines[len(demo["steps"])].split(":")[0].endswith("/mmidx-demo")
    assert Path(demo["workdir"]).name == "mmidx-demo"
