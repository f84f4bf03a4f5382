"""The ``mmidx-cli`` directive: the CLI reference generated from mmidx's own argparse parsers.

It walks :func:`mmidx.cli.build_parser` and renders, for the program and each sub-command, its description,
usage and every option with its help text, as ``--help`` prints them, so the reference cannot drift from the
code (nothing is copied by hand).

Help texts name what a wheel install has (``mmidx merge``, ``python -m pydoc mmidx.sources.chat_config``), never
a path of the repository; on the site those become links: a command to its section, a module to the page that
documents it (:data:`MODULE_PAGES`), and each command's section ends with its guide (:data:`COMMAND_PAGES`). A
module or command without a page fails the build, so no mention is left unlinked.
"""

import argparse
import re

from docutils import nodes
from sphinx import addnodes
from sphinx.errors import ExtensionError
from sphinx.util.docutils import SphinxDirective

# The page that documents each module a help text sends the reader to with ``python -m pydoc MODULE``.
MODULE_PAGES = {"mmidx.sources.chat_config": "guide/chat"}
# The guide page of each command, linked at the end of its section.
COMMAND_PAGES = {
    "build": "guide/building", "merge": "guide/building", "inspect": "guide/inspecting", "verify": "guide/verify",
    "sample": "guide/inspecting", "export": "guide/inspecting", "fetch": "guide/storage", "cache": "guide/storage",
    "precache": "guide/precache", "index": "guide/packing", "show": "guide/inspecting", "bench": "guide/inspecting",
    "view": "guide/inspecting",
    "demo": "getting-started",
}
_MENTION = re.compile(r"python -m pydoc (\w+(?:\.\w+)*)|\bmmidx ([a-z]+)\b")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _page_link(page: str, text: str | None = None) -> addnodes.pending_xref:
    """A link to the documentation page ``page`` (its title, or ``text`` as code); Sphinx resolves it (-W: a
    page that does not exist fails the build)."""
    link = addnodes.pending_xref("", refdomain="std", reftype="doc", reftarget=f"/{page}", refexplicit=text is not None)
    link += nodes.literal(text=text) if text else nodes.inline(text=page)
    return link


def linked_paragraph(text: str, commands: set[str]) -> nodes.paragraph:
    """``text`` as a paragraph, each ``mmidx COMMAND`` a link to its section and each ``python -m pydoc MODULE`` a
    link to the page :data:`MODULE_PAGES` names for it."""
    paragraph, start = nodes.paragraph(), 0
    for match in _MENTION.finditer(text):
        module, command = match.groups()
        if command is not None and command not in commands:
            continue  # "mmidx dataset", "mmidx demo's": not a command
        paragraph += nodes.Text(text[start:match.start()])
        if module is not None:
            if module not in MODULE_PAGES:
                raise ExtensionError(f"a help text names python -m pydoc {module}: add its page to MODULE_PAGES")
            paragraph += _page_link(MODULE_PAGES[module], match.group(0))
        else:
            link = nodes.reference("", "", refid=f"mmidx-{command}")
            link += nodes.literal(text=match.group(0))
            paragraph += link
        start = match.end()
    paragraph += nodes.Text(text[start:])
    return paragraph


def _section(document, title: str, ids: str) -> nodes.section:
    section = nodes.section(ids=[ids])
    section += nodes.title(text=title)
    document.note_implicit_target(section, section)
    return section


class CLIReference(SphinxDirective):
    """Render ``mmidx --help`` and every ``mmidx COMMAND --help``, one section per command."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from mmidx.cli import build_parser

        parser = build_parser()
        commands = _subparsers(parser)
        if missing := set(commands) - set(COMMAND_PAGES):
            raise ExtensionError(f"commands without a guide page in COMMAND_PAGES: {', '.join(sorted(missing))}")
        result: list[nodes.Node] = [self._describe(parser, "mmidx", set(commands))]
        for name, sub in commands.items():
            section = _section(self.state.document, f"mmidx {name}", f"mmidx-{name}")
            section += self._describe(sub, f"mmidx {name}", set(commands) - {name}).children
            guide = nodes.paragraph(text="Guide: ")
            guide += _page_link(COMMAND_PAGES[name])
            section += guide
            result.append(section)
        return result

    def _describe(self, parser: argparse.ArgumentParser, prog: str, commands: set[str]) -> nodes.container:
        container = nodes.container()
        parser.prog = prog
        if parser.description:
            container += linked_paragraph(parser.description, commands)
        container += nodes.literal_block(text=parser.format_usage().strip(), language="text")
        items = nodes.definition_list()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            names = ", ".join(action.option_strings) or action.dest
            if action.option_strings and action.nargs != 0:
                names += " " + (action.metavar if isinstance(action.metavar, str) else action.dest.upper())
            if action.help == argparse.SUPPRESS:
                continue
            help_text = parser._get_formatter()._expand_help(action) if action.help else ""
            item = nodes.definition_list_item()
            item += nodes.term(text=names)
            item += nodes.definition("", linked_paragraph(help_text, commands))
            items += item
        container += items
        for paragraph in (parser.epilog or "").strip().split("\n\n"):  # prose wraps; a table (indented) is kept
            if all(line.startswith(" ") for line in paragraph.splitlines()):
                container += nodes.literal_block(text=paragraph, language="text")
            elif paragraph:
                container += linked_paragraph(" ".join(paragraph.split()), commands)
        return container


def setup(app):
    app.add_directive("mmidx-cli", CLIReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
