"""``MMIDXError``: the one base of every error mmidx raises on purpose.

Each stage names its own kind (:class:`~mmidx.format.FormatError` for files that break the format,
``StorageError``, ``ImageError``, ``TokenizerError``, ``SourceError``, ``BuildError``...), and all of them
derive from this class, so a caller — the command line first — can tell mmidx's verdict on its input from
a bug: ``except MMIDXError`` catches every error whose message is meant for the user, and nothing else.
Kinds that are also a built-in kind (a FormatError is a ValueError) keep that base too.
"""

import contextlib
import contextvars
import importlib
from collections.abc import Iterator
from typing import Any

_COMMAND_LINE = contextvars.ContextVar("mmidx_command_line", default=False)


class MMIDXError(Exception):
    """An error mmidx raises on purpose, whose message says what is wrong and what to do."""


class MissingExtraError(MMIDXError, ImportError):
    """An optional framework (Ray, Lightning, the web viewer's stack...) that this use needs is not installed."""


def import_extra(module: str, extra: str, use: str) -> Any:
    """Import the optional ``module`` that ``use`` needs, or raise one line saying which extra installs it.

    Optional frameworks are imported only where they are used, through this, so ``import mmidx`` never needs
    them and a missing one is a :class:`MissingExtraError` naming ``pip install "mmidx[EXTRA]"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MissingExtraError(f'{use} needs {module.split(".")[0]}: pip install "mmidx[{extra}]"') from error


def option(parameter: str, value: Any = None) -> str:
    """How a message names the setting ``parameter`` (a Python parameter, e.g. ``max_skip_rate``), in the words of
    the interface in use: the command line's option (``--max-skip-rate``; a flag as itself, ``--force``) while an
    ``mmidx`` command runs (:func:`command_line`), else the parameter (``max_skip_rate``; with ``value``:
    ``force=True``). One spelling rule joins them: the option is the parameter with hyphens, after ``--``."""
    if _COMMAND_LINE.get():
        return "--" + parameter.replace("_", "-")
    return parameter if value is None else f"{parameter}={value!r}"


@contextlib.contextmanager
def command_line() -> Iterator[None]:
    """Within this block, messages name settings as the command line's options (see :func:`option`)."""
    token = _COMMAND_LINE.set(True)
    try:
        yield
    finally:
        _COMMAND_LINE.reset(token)
