"""The documentation site as a reader at 1280 px sees it: wide text blocks fit, and the CLI reference links what its
help texts name (commands, modules, each command's guide)."""

import argparse
import importlib.util
import re
from pathlib import Path

import pytest
from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError

from mmidx.cli import build_parser

DOCS = Path(__file__).resolve().parent.parent / "docs"
COMMANDS = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def _cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "_ext" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_wide_text_blocks_fit_at_1280_px():
    """The rules checked by screenshots of the built site at 1280 px (headless Chromium, issue 43): at 80em the
    article takes the width the navigation leaves (furo's 46em hold ~82 columns of code; the pipeline diagram has
    104, the demo's output 120) and text blocks use a smaller font."""
    css = (DOCS / "_static" / "mmidx.css").read_text()
    wide = re.search(r"@media \(min-width: 63em\) and \(max-width: 82em\) \{(.*?)\n\}", css, re.S)
    assert wide and ".sidebar-drawer { width: 15em; }" in wide[1] and ".content { width: 100%;" in wide[1]
    assert re.search(r"\.highlight-text pre \{ font-size: 0\.75rem; \}", css)
    conf = (DOCS / "conf.py").read_text()
    assert 'html_static_path = ["_static"]' in conf and 'html_css_files = ["mmidx.css"]' in conf
    widest = max(len(line) for line in (DOCS / "index.md").read_text().split("```text")[1].split("```")[0].splitlines())
    assert widest * 0.75 * 16 * 0.6 < 80 * 16 - 15 * 16 - 4 * 16  # 12 px monospace, under the article's width


def test_every_command_has_a_guide_page_and_every_page_exists():
    reference = _cli_reference()
    assert set(reference.COMMAND_PAGES) == set(COMMANDS)
    for page in [*reference.COMMAND_PAGES.values(), *reference.MODULE_PAGES.values()]:
        assert (DOCS / f"{page}.md").is_file(), page


def test_help_texts_mention_commands_and_modules_as_links():
    reference = _cli_reference()
    paragraph = reference.linked_paragraph("run mmidx merge, then see python -m pydoc mmidx.sources.chat_config.",
                                           {"merge"})
    links = list(paragraph.findall(nodes.reference))
    assert [link["refid"] for link in links] == ["mmidx-merge"] and links[0].astext() == "mmidx merge"
    [xref] = paragraph.findall(addnodes.pending_xref)
    assert xref["reftarget"] == "/guide/chat" and xref.astext() == "python -m pydoc mmidx.sources.chat_config"
    assert paragraph.astext() == "run mmidx merge, then see python -m pydoc mmidx.sources.chat_config."
    assert not list(reference.linked_paragraph("an mmidx dataset", {"merge"}).findall(nodes.reference))
    with pytest.raises(ExtensionError, match="MODULE_PAGES"):
        reference.linked_paragraph("python -m pydoc mmidx.nowhere", set())


def test_every_module_a_help_text_names_has_a_page():
    reference = _cli_reference()
    named = {module for sub in COMMANDS.values()
             for module in re.findall(r"python -m pydoc (\w+(?:\.\w+)*)", " ".join(sub.format_help().split()))}
    assert named and named <= set(reference.MODULE_PAGES)


def test_the_readmes_docs_command_documents_the_installed_package_after_pip_install(tmp_path):
    """After ``pip install ".[docs]"`` (a wheel: the kernels are built into site-packages, not the checkout),
    ``python -m sphinx ... docs`` run in the checkout imports the installed mmidx, whose kernels load, not the
    checkout's, which has none (15 autodoc imports failed); the ``docs`` extra brings what conf.py loads."""
    import shutil
    import subprocess
    import sys

    import tomllib

    import mmidx

    site, checkout = tmp_path / "site", tmp_path / "checkout"
    shutil.copytree(Path(mmidx.__file__).parent, site / "mmidx", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "mmidx-0.0.dist-info").mkdir()
    (site / "mmidx-0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: mmidx\nVersion: 0.0\n")
    shutil.copytree(DOCS, checkout / "docs", ignore=shutil.ignore_patterns("_build", "__pycache__"))
    shutil.copytree(Path(mmidx.__file__).parent, checkout / "mmidx",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    probe = ("import runpy, sys; conf = runpy.run_path('docs/conf.py'); import mmidx, mmidx._reader; "
             "print(mmidx.__file__, mmidx._reader.__file__); print(*conf['extensions'], conf['html_theme'])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=checkout, capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    where, loaded = result.stdout.splitlines()
    package, kernels = where.split()
    assert package == str(site / "mmidx" / "__init__.py") and Path(kernels).parent == site / "mmidx"
    extras = tomllib.loads((DOCS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    brought = {re.split(r"[<>=!~ ;\[]", requirement)[0].replace("-", "_") for requirement in extras["docs"]}
    needed = {name.partition(".")[0] for name in loaded.split() if name != "cli_reference"}  # _ext is docs' own
    assert needed | {"sphinx"} == brought
    readme = (DOCS.parent / "README.md").read_text()
    assert '`pip install ".[docs]" && python -m sphinx -W --keep-going -b html docs docs/_build/html`' in readme
