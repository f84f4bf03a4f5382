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
