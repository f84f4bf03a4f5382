"""The package's shape: folders are the pipeline's stages, imports run down the pipeline, no cycles, one error base.

The import graph is read from the source (every ``import`` and ``from ... import``, at module level or inside a
function; only the annotations-only block under ``if TYPE_CHECKING:`` is left out, since it never runs). An
import of ``mmidx.a.b`` also imports the package ``mmidx.a`` first, so it counts as an edge to both.
"""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import mmidx
from mmidx.errors import MissingExtraError, MMIDXError

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mmidx"
# The pipeline, bottom first: a module may import modules of its own stage or of stages before it, never after.
STAGES = ("errors", "format", "_ext", "io", "images", "tokenizer", "read", "config", "fetch", "sources", "ingest",
          "index", "encodings", "pack", "train", "toolkit", "ray", "view", "cli")
MAX_LINES = 400
# format.py is the byte-level specification with the readers and writers of every file, as numpy's _format_impl
# is: one module on purpose, so that the spec and the code that implements it are read together.
LONGER_ON_PURPOSE = {"mmidx.format"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
EXTENSIONS = {f"mmidx.{pyx.stem}" for pyx in (ROOT / "csrc").glob("*.pyx")}


def stage(module: str) -> str:
    if module in EXTENSIONS:
        return "_ext"
    return module.split(".")[1]


def _type_checking_block(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _imports(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _type_checking_block(node):
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:  # ``from mmidx.a import b`` imports the module mmidx.a.b where there is one
                submodule = f"{node.module}.{alias.name}"
                yield submodule if submodule in MODULES or submodule in EXTENSIONS else node.module
        else:
            yield from _imports(node)


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for name, path in MODULES.items():
        edges = set()
        for target in _imports(ast.parse(path.read_text())):
            if not (target == "mmidx" or target.startswith("mmidx.")):
                continue
            parts = target.split(".")
            for depth in range(2, len(parts) + 1):  # the packages on the way are imported too
                parent = ".".join(parts[:depth])
                if not name.startswith(parent + ".") and parent != name:
                    edges.add(parent)
            if target == "mmidx":
                edges.add("mmidx")
        graph[name] = edges
    return graph


def test_every_import_runs_down_the_pipeline():
    against = []
    for source, targets in import_graph().items():
        if source == "mmidx":  # the facade: its names are imported on first use, by string
            continue
        for target in targets:
            if target != "mmidx" and STAGES.index(stage(target)) > STAGES.index(stage(source)):
                against.append(f"{source} ({stage(source)}) imports {target} ({stage(target)})")
    assert not against, "\n".join(sorted(against))


def test_every_module_lives_in_a_stage_folder_or_is_a_stage():
    for name in MODULES:
        if name != "mmidx":
            assert stage(name) in STAGES, f"{name} is in no stage of the pipeline"


def test_there_is_no_import_cycle():
    graph = import_graph()
    index, low, on_stack, stack, cycles, counter = {}, {}, set(), [], [], [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, cycles


def test_the_graph_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a made-up pair of modules importing each other, one of them upwards."""
    fake = {"mmidx.read.x": tmp_path / "x.py", "mmidx.pack.y": tmp_path / "y.py"}
    fake["mmidx.read.x"].write_text("def f():\n    from mmidx.pack.y import g\n")
    fake["mmidx.pack.y"].write_text("from mmidx.read.x import f\n")
    monkeypatch.setattr(f"{__name__}.MODULES", {**MODULES, **fake})
    graph = import_graph()
    assert "mmidx.pack.y" in graph["mmidx.read.x"] and "mmidx.read.x" in graph["mmidx.pack.y"]
    with pytest.raises(AssertionError, match=r"mmidx\.read\.x"):
        test_there_is_no_import_cycle()
    with pytest.raises(AssertionError, match=r"mmidx\.read\.x \(read\) imports mmidx\.pack\.y \(pack\)"):
        test_every_import_runs_down_the_pipeline()


def test_no_module_is_longer_than_one_sitting():
    long = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    long = {name: lines for name, lines in long.items() if lines > MAX_LINES and name not in LONGER_ON_PURPOSE}
    assert not long, long


def test_every_error_mmidx_defines_derives_from_one_base():
    """Every module is imported and its exception classes checked; a module of an optional framework that is
    not installed (torchtitan's adapter without torchtitan) is checked as far as it goes, then the test skips
    naming it, so a machine without the extra neither fails nor passes as if everything had been checked."""
    errors, unimportable = [], []
    for info in pkgutil.walk_packages(mmidx.__path__, "mmidx."):
        if info.name.endswith("__main__"):
            continue
        try:
            module = importlib.import_module(info.name)
        except MissingExtraError as missing:
            unimportable.append(f"{info.name} ({missing})")
            continue
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == info.name and issubclass(cls, BaseException):
                errors.append(cls)
    assert len(errors) >= 8
    assert [cls for cls in errors if not issubclass(cls, MMIDXError)] == []
    if unimportable:
        pytest.skip("not checked, an optional framework is missing: " + "; ".join(unimportable))


def test_test_modules_import_helpers_from_support_not_from_each_other():
    tests = {path.stem for path in (ROOT / "tests").glob("*.py")}
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for name in _imports(ast.parse(path.read_text())):
            if name.split(".")[0] in tests and name.split(".")[0] != "conftest":
                offenders.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not offenders, offenders
