"""The ``mmidx-cli`` directive: the CLI reference generated from mmidx's own argparse parsers.

It walks :func:`mmidx.cli.build_parser` and renders, for the program and each sub-command, its description,
usage and every option with its help text, as ``--help`` prints them, so the reference cannot drift from the
code (nothing is copied by hand).
"""

import argparse

from docutils import nodes
from sphinx.util.docutils import SphinxDirective


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


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
        result: list[nodes.Node] = [self._describe(parser, "mmidx", "mmidx")]
        for name, sub in _subparsers(parser).items():
            section = _section(self.state.document, f"mmidx {name}", f"mmidx-{name}")
            section += self._describe(sub, f"mmidx {name}", f"mmidx-{name}").children
            result.append(section)
        return result

    def _describe(self, parser: argparse.ArgumentParser, prog: str, ids: str) -> nodes.container:
        container = nodes.container()
        parser.prog = prog
        if parser.description:
            container += nodes.paragraph(text=parser.description)
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
            item += nodes.definition("", nodes.paragraph(text=help_text))
            items += item
        container += items
        if parser.epilog:
            container += nodes.literal_block(text=parser.epilog.strip(), language="text")
        return container


def setup(app):
    app.add_directive("mmidx-cli", CLIReference)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
