"""Check that an environment holds mmidx's core install only: no package that only an extra or the tests need.

Run with the interpreter of the environment under test (``.ci/wheel`` runs it in the fresh venv the wheel was
installed into, before ``mmidx demo``, so that the demo is proven to run on the core install alone)::

    python tools/check_core_only.py

Every package named by an extra of the installed mmidx's metadata (``ray``, ``hf``, ``test``...) must be
absent, unless a core dependency itself requires it (then it is part of the core install). Prints the
environment's package count; exit status 0 when all is well, 1 with one line per extra package otherwise.
"""

import importlib.metadata
import re
import sys


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def core_closure() -> set[str]:
    """Names of mmidx and every package its core requirements pull in, transitively, as installed."""
    seen, todo = set(), ["mmidx"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        todo += [_name(r) for r in requires if "extra ==" not in r]
    return seen


def main() -> int:
    installed = {_name(dist.metadata["Name"]) for dist in importlib.metadata.distributions()}
    extras = {_name(r) for r in importlib.metadata.requires("mmidx") or [] if "extra ==" in r}
    unexpected = sorted((extras & installed) - core_closure())
    for name in unexpected:
        print(f"{name} is installed, but only an extra of mmidx needs it: the environment is not a core install")
    if unexpected:
        return 1
    print(f"core install: {len(installed)} packages, none of mmidx's extras")
    return 0


if __name__ == "__main__":
    sys.exit(main())
