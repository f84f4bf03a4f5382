"""Sphinx configuration of mmidx's documentation site (Sphinx + MyST, as Megatron-Energon, Streaming and Ray).

Built offline, warnings as errors: ``python -m sphinx -W --keep-going -n -b html docs docs/_build/html``
(``.ci/run`` does it), after ``pip install ".[docs]"`` (Sphinx, MyST, Furo).
The CLI reference is generated from mmidx's argparse parsers (``_ext/cli_reference``),
the API reference and the format specification from the docstrings (autodoc).
"""

import importlib.metadata
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def documented_root() -> Path:
    """The folder whose ``mmidx`` the manual documents: the checkout when its kernels are built there (a development
    install, ``pip install -e .``), else the installed package's (``pip install .`` builds the kernels into
    site-packages, not the checkout, whose ``mmidx`` would fail every autodoc import)."""
    if any(any((ROOT / "mmidx").glob(f"_reader*{suffix}")) for suffix in (".so", ".pyd")):
        return ROOT
    try:
        installed = Path(importlib.metadata.distribution("mmidx").locate_file("mmidx"))
    except importlib.metadata.PackageNotFoundError:
        return ROOT
    return installed.parent if (installed / "__init__.py").is_file() else ROOT


sys.path.insert(0, str(documented_root()))
sys.path.insert(0, str(Path(__file__).resolve().parent / "_ext"))

import mmidx  # noqa: E402

project = "mmidx"
release = version = mmidx.__version__
extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "cli_reference"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]
html_theme = "furo"
html_title = f"mmidx {release}"
autodoc_member_order = "bysource"
autodoc_typehints = "description"
# Warnings are errors (broken internal links and cross-references between the pages fail the build). Python
# cross-references are not nitpicky: the public names' docstrings refer to internal modules and classes on purpose
# (the API reference shows the public names only), and external inventories cannot be fetched offline.
nitpicky = False
# Options such as --help stay two hyphens (docutils would typeset "--" as an en dash).
smartquotes = False
# mmidx.css: wide text blocks (the pipeline diagram, command output) fit the page at 1280 px (see the file).
html_static_path = ["_static"]
html_css_files = ["mmidx.css"]
