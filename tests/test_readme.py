"""The README runs as written.

Every ```bash and ```python block of README.md runs, in the README's order, in one sandbox folder that
holds, tiny, the inputs the blocks name (a ``Qwen2-7B/`` tokenizer folder, t2i parquet under
``data/t2i/``, ``edits.parquet``, ``llava.jsonl`` with its ``images/``, ``clips.jsonl`` with its videos in
``clips/``, ``corpus.jsonl``, a BAGEL data config ``bagel.yaml`` and its ``info.yaml``) beside the demo's
``mmidx-demo/``: each block sees what the blocks before it wrote, as a reader's shell would. The conventions
the README follows:

* ```bash and ```python: run, and must succeed (exit status 0, no traceback);
* a ```bash or ```python block whose first line is ``# needs: WHAT`` needs what a test lacks (a cluster,
  an hour): it is not run, but it must parse, and each ``mmidx`` command line in it must be accepted by
  mmidx's own parser (each ``python SCRIPT`` one's options must be in its help);
* ```text (output, diagrams, layouts) and ```diff: read, never run (the trainer diff's call is checked);
* ```text output: what the runnable block right above it on the page prints (its standard output), compared
  with what that block prints here: the shown lines must be a run of the printed lines (an excerpt may leave
  lines out before and after, none between), after the same normalisation of both (:data:`NORMALISED`: the
  sandbox folder's path, durations and rates, which depend on the machine and its load). A block showing
  output that is not compared says so on the page (an example of one run, figures that depend on the
  machine);
* the Quick start's two commands install packages and run this suite: CI runs them (``.ci/run``).

The shell's ``mmidx`` runs ``mmidx.cli.main`` in a child forked from one process that imported it
(:mod:`support.cli_server`), so that each command does not spend seconds importing torch.

Any other fence fails :func:`test_every_block_is_run_or_marked_for_reading`, so a new block either runs
here or says why it cannot.
"""

import ast
import contextlib
import difflib
import functools
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import yaml
from support import cli_server
from support.sources import WORDS, image_bytes, qwen_dir, write_jsonl, write_mp4, write_parquet, write_t2i_parquet

from mmidx.errors import MissingExtraError

ROOT = Path(__file__).resolve().parent.parent
RUN, READ = ("bash", "python"), ("text", "diff", "yaml")
NEEDS = "# needs:"
OUTPUT = "output"
# What a shown output may differ in from the printed one, replaced in both before they are compared: durations
# and rates (the machine and its load), and the load average itself. The sandbox folder's path is replaced too.
NORMALISED = [
    (re.compile(r"\b\d[\d,]*(\.\d+)? ?(ms|µs|s|min|h)\b"), "<duration>"),
    (re.compile(r"\b\d[\d,]*(\.\d+)? ?([kMG]?B|[\w ]+?)/s\b"), "<rate>"),
    (re.compile(r"\bload (average )?(of )?\d+(\.\d+)?"), "load <load>"),
]


@dataclass(frozen=True)
class Block:
    """One fenced code block of README.md or a page of docs/."""

    language: str
    code: str
    line: int  # of the opening fence
    section: str  # the heading above it
    page: str = "README.md"
    info: str = ""  # what follows the language on the opening fence: "output" for a shown output

    @property
    def shows_output(self) -> bool:
        """Whether the block is a ```text output block: what the block above it prints, compared."""
        return self.language == "text" and self.info == OUTPUT

    @property
    def needs(self) -> str | None:
        """What a block marked ``# needs: WHAT`` on its first line needs; None for a block that runs here."""
        first = self.code.split("\n", 1)[0]
        return first.removeprefix(NEEDS).strip() if first.startswith(NEEDS) else None

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line} ({self.section})"


def toctree_entries(page: Path) -> list[str]:
    """The documents a page's ```{toctree} blocks list, in order (globs left out: they come after, sorted)."""
    entries, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```{toctree}"):
            inside = True
        elif inside and line.startswith("```"):
            inside = False
        elif inside and line.strip() and not line.startswith(":") and "*" not in line:
            entries.append(line.strip())
    return entries


def pages() -> list[Path]:
    """README.md, then every docs/**/*.md in the order a reader follows the site's toctrees (each page's blocks
    run in the folder the pages before it left), then any page no toctree lists."""
    docs, ordered = ROOT / "docs", []

    def visit(page: Path) -> None:
        if page in ordered or not page.exists():
            return
        ordered.append(page)
        for entry in toctree_entries(page):
            visit((page.parent / entry).with_suffix(".md"))
        for rest in sorted(page.parent.glob("*.md")) if page.name == "index.md" else []:
            visit(rest)

    visit(docs / "index.md")
    rest = [page for page in sorted(docs.rglob("*.md")) if "_build" not in page.parts and page not in ordered]
    return [ROOT / "README.md", *ordered, *rest]


def page_blocks(path: Path) -> list[Block]:
    blocks, section, opened, body = [], "", None, []
    name = str(path.relative_to(ROOT))
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if opened is None and line.startswith("#"):
            section = line.lstrip("#").strip()
        elif opened is None and line.startswith("```"):
            opened, body = (line[3:].strip(), number), []
        elif opened is not None and line.startswith("```"):
            if not opened[0].startswith("{"):  # a MyST directive (toctree, eval-rst, mmidx-cli), not code
                language, _, info = opened[0].partition(" ")
                blocks.append(Block(language, "".join(body), opened[1], section, name, info.strip()))
            opened = None
        elif opened is not None:
            body.append(line + "\n")
    assert opened is None, f"{name} line {opened[1]}: a code block is never closed"
    return blocks


def doc_blocks() -> list[Block]:
    """Every code block of the README and the docs, in reading order."""
    return [block for page in pages() for block in page_blocks(page)]


def readme_blocks() -> list[Block]:
    return page_blocks(ROOT / "README.md")


def quick_start() -> Block:
    return next(block for block in readme_blocks() if block.section == "Quick start" and block.language == "bash")


def quick_start_commands() -> list[str]:
    return [line.strip() for line in quick_start().code.splitlines() if line.strip()]


def test_quick_start_is_exactly_two_commands():
    assert len(quick_start_commands()) == 2


def ci_quick_start_commands(folder: Path = ROOT) -> subprocess.CompletedProcess:
    """What ``.ci/quickstart --commands`` of ``folder`` prints: the commands it reads from that folder's README.md."""
    return subprocess.run(["bash", str(folder / ".ci" / "quickstart"), "--commands"], capture_output=True, text=True,
                          timeout=60)


def test_ci_runs_the_quick_start_read_from_the_readme_then_the_demo_again():
    """.ci/quickstart reads the commands from README.md itself (its own parser, against this file's)."""
    listed = ci_quick_start_commands()
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == [*quick_start_commands(), "mmidx demo"]


def test_ci_reads_the_quick_start_block_wherever_it_is_and_refuses_a_readme_without_one(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / ".ci" / "quickstart").write_bytes((ROOT / ".ci" / "quickstart").read_bytes())
    (tmp_path / "README.md").write_text(textwrap.dedent("""\
        # A project

        ```bash
        echo not this one
        ```

        ### Quick start

        ```text
        nor this
        ```

        ```bash
          first command && second

        # a comment is a command line too
        ```

        ```bash
        not after the block
        ```
        """))
    listed = ci_quick_start_commands(tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines() == ["first command && second", "# a comment is a command line too", "mmidx demo"]
    (tmp_path / "README.md").write_text("# A project\n\n## Quick start\n\nRun the demo.\n")
    listed = ci_quick_start_commands(tmp_path)
    assert listed.returncode == 1 and listed.stdout == ""
    assert listed.stderr == "README.md: no ```bash block under '## Quick start'\n"


def test_ci_runs_the_quick_start_before_it_installs_or_checks_anything_else():
    """The quick start must meet the machine as a newcomer's: nothing that .ci/run installs comes before it."""
    steps = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    first = steps.index('bash .ci/quickstart "$work"')
    assert not [step for step in steps[:first] if re.search(r"\b(pip|apt-get|python|pytest|ruff|sphinx|mmidx)\b", step)]
    order = ["pip install -q -r requirements-dev.txt", "pip install -q --no-deps torchtitan==0.3.0",
             "apt-get install", "ruff check .", "tools/skipped_tests.py", "python -m pytest", "python -m sphinx",
             "bash .ci/wheel"]
    where = [next(number for number, step in enumerate(steps) if later in step) for later in order]
    assert first < where[0] and where == sorted(where), dict(zip(order, where, strict=True))


def test_every_block_is_run_or_marked_for_reading():
    for block in doc_blocks():
        assert block.language in RUN + READ, (
            f"{block.where}: a ```{block.language} block; use ```bash or ```python (run by this test), or "
            "```text for output and diagrams")
        assert block.needs != "", f"{block.where}: say what the block needs after '{NEEDS}'"


def documented_imports() -> list[tuple[str, str, str]]:
    """(module, name, where) of every ``from mmidx... import NAME`` and ``import mmidx...`` of the python blocks."""
    found = []
    for block in doc_blocks():
        if block.language != "python":
            continue
        for node in ast.walk(ast.parse(block.code)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mmidx":
                found += [(node.module, alias.name, block.where) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [(alias.name, "", block.where) for alias in node.names if alias.name.split(".")[0] == "mmidx"]
    return found


def defines(module: str, name: str) -> bool:
    """Whether the source of ``module`` (found, not imported) binds ``name`` at its top level."""
    tree = ast.parse(Path(importlib.util.find_spec(module).origin).read_text())
    bound = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            bound.update(target.id for target in targets if isinstance(target, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return name in bound


def test_every_name_the_docs_import_exists_at_a_public_path():
    """Every import of the README and the docs works, from a path with no private or internal part (a user's
    guess: ``mmidx``, ``mmidx.ray``, ``mmidx.view``, ``mmidx.train.lightning``; not ``mmidx.toolkit...``).

    A module of an optional framework that is not installed (torchtitan's adapter without torchtitan) is checked in
    its source (it exists and defines the name), then the test skips naming it, as the README promises for an
    absent framework's tests: it neither fails nor passes as if the import had been tried."""
    imports = documented_imports()
    assert {module for module, _, _ in imports} >= {"mmidx", "mmidx.ray", "mmidx.view"}
    unimportable = set()
    for module, name, where in imports:
        assert not any(part.startswith("_") or part == "toolkit" for part in module.split(".")), f"{where}: {module}"
        try:
            imported = importlib.import_module(module)
        except MissingExtraError as missing:
            assert not name or defines(module, name), f"{where}: {module}.{name}"
            unimportable.add(f"{module} ({missing})")
            continue
        assert not name or getattr(imported, name) is not None, f"{where}: {module}.{name}"
    if unimportable:
        pytest.skip("checked in the source only, an optional framework is missing: " + "; ".join(sorted(unimportable)))


def test_the_source_check_of_an_unimportable_module_finds_what_it_binds_and_only_that():
    assert defines("mmidx.train.torchtitan", "PackDataloader") and defines("mmidx.train.torchtitan", "BaseDataLoader")
    assert defines("mmidx.errors", "import_extra") and defines("mmidx.tokenizer", "HUB_TIMEOUT")
    assert not defines("mmidx.train.torchtitan", "PackDataLoader") and not defines("mmidx.errors", "MMIDXWarning")


def test_an_absent_framework_makes_the_import_check_skip_naming_it_not_fail(monkeypatch):
    """The README promises that an absent framework's tests skip: torchtitan hidden, as a fresh venv lacks it."""
    for module in ["torchtitan", *(name for name in sys.modules if name.startswith("torchtitan."))]:
        monkeypatch.setitem(sys.modules, module, None)  # ``import torchtitan...`` raises ImportError
    monkeypatch.delitem(sys.modules, "mmidx.train.torchtitan", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"mmidx\.train\.torchtitan \(mmidx\.train\.torchtitan needs "
                                                    r"torchtitan: pip install \"mmidx\[torchtitan\]\"\)"):
        test_every_name_the_docs_import_exists_at_a_public_path()


def test_the_api_reference_documents_every_public_name():
    """docs/reference/api.md renders each name of ``mmidx.__all__`` (autodoc), and only public names."""
    import mmidx

    text = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = set(re.findall(r"^\.\. auto(?:class|function):: mmidx\.(\w+)$", text, re.M))
    assert documented == set(mmidx.__all__) - {"__version__"}
    for name in documented:
        assert getattr(mmidx, name).__doc__, name


def test_the_trainer_diff_calls_trainer_loader_as_it_is_defined():
    """The diff against BAGEL's trainer is read, not run (it needs BAGEL): its new side imports what mmidx has
    and calls ``trainer_loader`` with arguments its signature takes."""
    from mmidx.train.bagel import trainer_loader

    (diff,) = [block for block in doc_blocks() if block.language == "diff"]
    new_side = [line[1:] for line in diff.code.splitlines() if line[:1] in ("+", " ")]
    assert "from mmidx.train.bagel import trainer_loader" in new_side
    start = next(number for number, line in enumerate(new_side) if "= trainer_loader(" in line)
    end = next(number for number in range(start, len(new_side)) if new_side[number].strip() == ")")
    (statement,) = ast.parse(textwrap.dedent("\n".join(new_side[start:end + 1]))).body
    signature = inspect.signature(trainer_loader)
    signature.bind(*statement.value.args, **{keyword.arg: keyword.value for keyword in statement.value.keywords})


def command_lines(code: str) -> list[list[str]]:
    """The simple commands of shell ``code`` (split at ``&&``, ``||``, ``;``, ``|``), without comments,
    ``nice`` and variable assignments; a ``$VARIABLE`` stands for a number (a node's rank), 0 here."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        command: list[str] = []
        for token in [*lexer, ";"]:
            if token in ("&&", "||", ";", "|", "&"):
                while command and (command[0] == "nice" or re.fullmatch(r"\w+=.*", command[0])):
                    command.pop(0)
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(re.sub(r"\$\{?\w+\}?", "0", token))
    return commands


@functools.cache
def script_help(script: str) -> str:
    """What ``python SCRIPT --help`` prints. A benchmark imports torch and its peers before it parses (10 CPU-s for
    bench_index.py): a minute and more on 2 cores shared with a load of 20, hence the long limit."""
    return subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600).stdout


def options_rejected(command: list[str]) -> str | None:
    """Why the program named by ``command`` would refuse its options before doing anything; None if it accepts."""
    if command[0] == "mmidx":
        from mmidx.cli import build_parser

        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                build_parser().parse_args(command[1:])
        except SystemExit as exit_:
            return stderr.getvalue() or f"exit status {exit_.code}"
        return None
    if command[0] == "python" and command[1].endswith(".py"):
        help_text = script_help(command[1])
        unknown = [option for option in command[2:] if option.startswith("--") and option not in help_text]
        return f"not in {command[1]} --help: {unknown}" if unknown else None
    return None


DEMO_TOKENIZER = "mmidx-demo/raw/tokenizer"  # what `mmidx demo` leaves: a tokenizer every reader has
TOKENIZER_NAMES = re.compile(r"--tokenizer[ =]+(\S+)|tokenizer=[\"']([^\"']+)"  # the CLI's, mmidx.write's
                             r"|write_mmidx\([^,]+,[^,]+,\s*[\"']([^\"']+)")  # Ray Data's, third argument


def tokenizers_not_shown(page: str, blocks: list[Block]) -> list[str]:
    """The tokenizers that ``blocks`` (of the page of text ``page``) run with but the reader may not have: every
    name but the demo's, unless the page shows, before the block, the one way to get it (``save_pretrained(NAME)``,
    with the network: a block that runs without the hub must name a tokenizer the reader has)."""
    lines, missing = page.splitlines(), []
    for block in blocks:
        if block.language not in RUN or block.needs:
            continue
        for match in TOKENIZER_NAMES.finditer(block.code):
            name = next(group for group in match.groups() if group)
            shown = f'save_pretrained("{name.rstrip("/")}")' in "\n".join(lines[:block.line])
            if name != DEMO_TOKENIZER and not shown:
                missing.append(f"{block.where}: {name}")
    return missing


def test_every_block_that_needs_a_tokenizer_names_one_the_reader_has_or_shows_how_to_get_it():
    """Without the hub, a name is a folder or nothing (own-data's ``tokenizer="Qwen2-7B"`` spent 52 s retrying
    the hub, then failed): each page names the demo's tokenizer, or first shows how to save Qwen2's."""
    checked = [(path, page_blocks(path)) for path in pages()]
    named = [match for _, blocks in checked for block in blocks if block.language in RUN and not block.needs
             for match in TOKENIZER_NAMES.finditer(block.code)]
    assert len(named) >= 10  # the pattern finds the CLI's, mmidx.write's and write_mmidx's
    assert [problem for path, blocks in checked for problem in tokenizers_not_shown(path.read_text(), blocks)] == []


def test_the_tokenizer_check_catches_a_name_the_page_never_shows_how_to_get():
    page = textwrap.dedent("""\
        # A page

        ```python
        report = mmidx.write(fn, rows, "out", tokenizer="Qwen2-7B", workers=2)
        ```

        Save it: `AutoTokenizer.from_pretrained("Qwen/Qwen2-7B").save_pretrained("Qwen2-7B")`.

        ```bash
        mmidx build --source t2i --input in/ --tokenizer Qwen2-7B/ --output ds/t2i
        mmidx build --source t2i --input in/ --tokenizer mmidx-demo/raw/tokenizer --output ds/t2i
        mmidx build --source t2i --input in/ --tokenizer=mine/ --output ds/t2i
        ```
        """)
    blocks = [Block(language, code, line, "A page", "page.md") for language, code, line in
              [("python", page.splitlines()[3] + "\n", 3), ("bash", "\n".join(page.splitlines()[9:12]) + "\n", 9)]]
    assert tokenizers_not_shown(page, blocks) == ["page.md line 3 (A page): Qwen2-7B", "page.md line 9 (A page): mine/"]


def test_the_extras_the_docs_list_are_pyprojects():
    """The README's install line, Getting started's sentence and own-data's table name every extra (``chat`` was
    left out), and only those."""
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = re.search(r"# extras: ([\w ]+)", (ROOT / "README.md").read_text()).group(1).split()
    started = (ROOT / "docs" / "getting-started.md").read_text()
    sentence = started[started.index("Each optional framework is\nan extra"):].split("combined as", 1)[0]
    own_data = (ROOT / "docs" / "guide" / "own-data.md").read_text()
    table = re.findall(r"^\| `(\w+)` \|", own_data[own_data.index("| extra | for | install |"):].split("\n\n")[0], re.M)
    assert sorted(readme) == sorted(extras - {"test"})
    assert sorted(re.findall(r"`(\w+)`", sentence)) == sorted(extras - {"test"})
    assert sorted(table) == sorted(extras)


def test_blocks_that_are_not_run_parse_and_use_options_that_exist():
    """What cannot run here (a cluster, an hour, the Quick start) is at least valid: the shell parses it and
    each command accepts its options."""
    unrun = [block for block in doc_blocks() if block.needs] + [quick_start()]
    assert any(block.language == "bash" for block in unrun)
    for block in unrun:
        if block.language == "python":
            compile(block.code, block.where, "exec")
            continue
        syntax = subprocess.run(["bash", "-n", "-c", block.code], capture_output=True, text=True)
        assert syntax.returncode == 0, f"{block.where}: {syntax.stderr}"
        commands = command_lines(block.code)
        assert commands, block.where  # a block of comments only says nothing a reader can run
        for command in commands:
            assert options_rejected(command) is None, f"{block.where}: {shlex.join(command)}: " \
                                                      f"{options_rejected(command)}"


def test_the_option_check_catches_a_misspelt_option():
    assert options_rejected(command_lines("mmidx build --sorce t2i --tokenizer t")[0])
    assert options_rejected(command_lines("mmidx bench ds --packs many")[0])
    assert options_rejected(command_lines("nice python tools/fuzz.py --cases 1 --cores 2")[0])
    assert options_rejected(command_lines("mmidx merge ds/t2i ds/t2i.shards --node-rank $RANK  # a comment")[0])
    assert options_rejected(command_lines("ruff check . && mmidx index x --cache-dir c --node-rank $RANK")[1])
    assert options_rejected(command_lines("mmidx build --source t2i --input in --tokenizer t --output o "
                                          "--num-nodes 8 --node-rank $RANK")[0]) is None


def write_readme_inputs(folder: Path) -> None:
    """What a reader's folder holds before the README's commands, tiny: the files and folders they name."""
    from mmidx.toolkit.demo import BAGEL_GROUPS

    rng = np.random.default_rng(0)

    def words(count: int) -> str:
        return " ".join(rng.choice(WORDS, size=count))

    (folder / "Qwen2-7B").symlink_to(qwen_dir(), target_is_directory=True)  # BAGEL's Qwen2 tokenizer files
    (folder / "data" / "t2i").mkdir(parents=True)
    for number in range(2):
        write_t2i_parquet(folder / "data" / "t2i" / f"chunk_{number}.parquet",
                          [image_bytes(48, 48, seed=10 * number + row) for row in range(4)],
                          [{"caption_short": words(6), "caption_long": words(20)} for _ in range(4)], 2)
    edits = {"image_list": [[image_bytes(32, 32, seed=100 + 3 * row + k) for k in range(3)] for row in range(4)],
             "instruction_list": [[[words(5)], [words(4), words(6)]] for _ in range(4)]}
    types = {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))}
    write_parquet(folder / "edits.parquet", edits, types, 2)
    (folder / "data" / "edit").mkdir()
    write_parquet(folder / "data" / "edit" / "chunk_0.parquet", edits, types, 2)
    (folder / "cat.png").write_bytes(image_bytes(40, 30, fmt="PNG", seed=300))  # the hf source's example
    (folder / "images").mkdir()
    for number in range(4):
        (folder / "images" / f"img_{number}.jpg").write_bytes(image_bytes(48, 48, seed=200 + number))
    write_jsonl(folder / "llava.jsonl", [
        {"id": line, "image": f"img_{line % 4}.jpg",
         "conversations": [{"from": "human", "value": "<image>\n" + words(6)}, {"from": "gpt", "value": words(12)}]}
        for line in range(128)])
    write_jsonl(folder / "corpus.jsonl", [{"text": words(60)} for _ in range(200)])
    (folder / "clips").mkdir()
    write_mp4(folder / "clips" / "walk.mp4", 24)
    write_mp4(folder / "clips" / "pour.mp4", 16)
    write_jsonl(folder / "clips.jsonl", [
        {"video": "walk.mp4", "caption": words(8)},
        {"video": "pour.mp4", "caption": {"0": words(6), "1": words(9)}, "condition_frames": 2}])
    (folder / "bagel.yaml").write_text(yaml.safe_dump(BAGEL_GROUPS, sort_keys=False))
    (folder / "info.yaml").write_text(yaml.safe_dump({
        "t2i_pretrain": {"t2i": {"data_dir": "data/t2i"}},
        "unified_edit": {"seedxedit_multi": {"data_dir": "data/edit"}},
        "vlm_sft": {"llava_ov": {"data_dir": "images", "jsonl_path": "llava.jsonl"}}}))


def normalised(text: str, folders: dict[str, str]) -> list[str]:
    """``text``'s lines as they are compared: ``folders`` (absolute path → the name shown) and :data:`NORMALISED`
    replaced, trailing spaces and blank lines at either end dropped."""
    for path, shown in sorted(folders.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, shown)
    for pattern, replacement in NORMALISED:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines()).strip("\n").splitlines()


def output_drift(block: Block, printed: str, folders: dict[str, str] | None = None) -> str | None:
    """None if the ```text output ``block`` is a run of the lines ``printed``, after normalisation; else a
    unified diff from the shown lines to the printed ones that match them best, saying how to update the page."""
    shown, lines = normalised(block.code, folders or {}), normalised(printed, folders or {})
    size = len(shown)
    if any(lines[start:start + size] == shown for start in range(max(len(lines) - size + 1, 1))):
        return None

    def alike(start: int) -> int:
        return sum(a == b for a, b in zip(shown, lines[start:start + size], strict=False))
    best = max(range(max(len(lines) - size + 1, 1)), key=alike)
    diff = difflib.unified_diff(shown, lines[best:best + size] if alike(best) else lines, lineterm="",
                                fromfile=f"{block.where}: shown", tofile="printed now (normalised)")
    return (f"{block.where}: the output shown is not what the block above it prints now; update the page "
            f"(lines starting with - are on the page, with + printed):\n" + "\n".join(diff))


def test_a_drifted_figure_in_a_shown_output_is_a_diff_naming_the_page():
    shown = Block("text", "  tight: fill_vs_max 0.986   step_balance 0.993\n", 99, "What a config wastes",
                  "docs/guide/packing.md", OUTPUT)
    printed = "index: 12 packs in 0.21 s\n  tight: fill_vs_max 0.987   step_balance 0.993\nwrote /tmp/x/ds\n"
    drift = output_drift(shown, printed)
    assert "docs/guide/packing.md line 99" in drift
    assert "-  tight: fill_vs_max 0.986   step_balance 0.993" in drift.splitlines()
    assert "+  tight: fill_vs_max 0.987   step_balance 0.993" in drift.splitlines()
    assert output_drift(shown, printed.replace("0.987", "0.986")) is None  # an excerpt of what was printed


def test_durations_rates_and_the_sandbox_path_are_normalised_and_nothing_else():
    shown = Block("text", "wrote ds/t2i in 1.2 s (340 samples/s, 12 MB/s)\nfill 85.9%, 12 packs\n", 1, "s",
                  info=OUTPUT)
    assert output_drift(shown, "wrote /sandbox/ds/t2i in 0.31 s (1,234 samples/s, 3.5 MB/s)\nfill 85.9%, 12 packs\n",
                        {"/sandbox/": ""}) is None
    assert output_drift(shown, "wrote ds/t2i in 1.2 s (340 samples/s, 12 MB/s)\nfill 85.8%, 12 packs\n")
    assert output_drift(shown, "wrote ds/t2i in 1.2 s (340 samples/s, 12 MB/s)\nfill 85.9%, 13 packs\n")


def test_each_shown_output_follows_a_block_that_runs_here():
    blocks = doc_blocks()
    shown = [number for number, block in enumerate(blocks) if block.shows_output]
    assert len(shown) >= 5
    for number in shown:
        above = blocks[number - 1]
        assert above.page == blocks[number].page and above.language in RUN and not above.needs, (
            f"{blocks[number].where}: a ```text output block shows what the runnable block right above it prints")
    for block in blocks:
        assert block.info in ("", OUTPUT), f"{block.where}: ```{block.language} {block.info}: unknown fence option"


def test_the_readmes_mixture_report_is_an_excerpt_of_the_guides_compared_output():
    """The README quotes a phase of the mixtures guide's ``--history`` report, which the guide's run compares."""
    (quoted,) = [block for block in readme_blocks() if block.code.startswith("phase 1: packs [10, 24)")]
    blocks = page_blocks(ROOT / "docs" / "guide" / "mixtures.md")
    (guide,) = [block for above, block in itertools.pairwise(blocks)
                if block.shows_output and "mmidx index --history" in above.code]
    assert output_drift(quoted, guide.code) is None


@pytest.mark.timeout(1800)  # over half the default: every block of the docs, 657 s with its setup at a load of 20
def test_every_bash_and_python_block_runs_as_written(demo, s3, cluster, tmp_path, monkeypatch):
    """Each block that is not marked runs unchanged, in order, in a folder holding the inputs it names
    (and, for the object-storage block, beside a local S3 server with the bucket it names; Ray Data's
    blocks on the session's Ray cluster)."""
    s3.client.create_bucket(Bucket="my-bucket")
    runnable = [block for block in doc_blocks()
                if block.language in RUN and not block.needs and block != quick_start()]
    assert {block.language for block in runnable} == set(RUN)
    write_readme_inputs(tmp_path)
    (tmp_path / "mmidx-demo").symlink_to(demo["workdir"], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespaces, printed = [], {}
    with cli_server.running(tmp_path) as env:
        for block in runnable:
            if block.language == "python":
                names: dict = {}
                with contextlib.redirect_stdout(io.StringIO()) as stdout:
                    exec(compile(block.code, block.where, "exec"), names)  # the README's own code
                namespaces.append(names)
                printed[block] = stdout.getvalue()
                continue
            result = subprocess.run(["bash", "-c", "set -xeuo pipefail\n" + block.code], cwd=tmp_path, env=env,
                                    capture_output=True, text=True, timeout=300)
            output = result.stdout + result.stderr
            assert result.returncode == 0 and "Traceback" not in output, f"{block.where}:\n{block.code}\n{output}"
            printed[block] = result.stdout
    # every output shown is what its block printed (docstring: the ```text output convention)
    blocks = doc_blocks()
    folders = {f"{tmp_path.resolve()}/": "", f"{tmp_path}/": "", f"{Path(demo['workdir']).resolve()}": "mmidx-demo"}
    drifts = [output_drift(block, printed[blocks[number - 1]], folders)
              for number, block in enumerate(blocks) if block.shows_output]
    assert not any(drifts), "\n\n".join(filter(None, drifts))
    # the training loop's example: two steps after `mmidx demo`, resumable from the state it saved
    names = next(names for names in namespaces if "checkpoint" in names)
    assert names["step"] == 1 and names["checkpoint"]["data"]["packs_consumed"] == 2
    assert set(names["data"]) >= {"sequence_length", "sample_lens", "packed_text_ids"}
    assert len(names["bounds"]) == 4 and names["tokens"].size == names["bounds"][-1]
    # what the shell blocks wrote is what their commands say they write
    assert json.loads((tmp_path / "ds" / "t2i.report.json").read_text())["samples"] == 8
    assert (tmp_path / "ds" / "data.yaml").exists() and (tmp_path / "pack.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "local" / "t2i.meta.json").exists()  # mmidx fetch of the dataset built to s3://


def test_the_demo_output_shown_is_the_demos_in_its_folder(demo):
    """The README shows the demo's step lines and its ./mmidx-demo folder, as the command prints them."""
    block = next(block for block in readme_blocks() if block.section == "Quick start" and block.language == "text")
    lines = block.code.splitlines()
    assert lines[:len(demo["steps"])] == [line for line, _ in demo["steps"]]
    assert lines[len(demo["steps"])].split(":")[0].endswith("/mmidx-demo")
    assert Path(demo["workdir"]).name == "mmidx-demo"
