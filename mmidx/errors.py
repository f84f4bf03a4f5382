"""``MMIDXError``: the one base of every error mmidx raises on purpose.

Each stage names its own kind (:class:`~mmidx.format.FormatError` for files that break the format,
``StorageError``, ``ImageError``, ``TokenizerError``, ``SourceError``, ``BuildError``...), and all of them
derive from this class, so a caller — the command line first — can tell mmidx's verdict on its input from
a bug: ``except MMIDXError`` catches every error whose message is meant for the user, and nothing else.
Kinds that are also a built-in kind (a FormatError is a ValueError) keep that base too.
"""

import importlib
from typing import Any


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
