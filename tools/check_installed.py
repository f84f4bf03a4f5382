"""Check an installed mmidx against the source tree it was built from: nothing left out, everything imports.

Run with the interpreter of the environment under test, from outside the source tree::

    python tools/check_installed.py SOURCE_ROOT

Every module of ``SOURCE_ROOT/mmidx`` (``.py`` files, and ``csrc/*.pyx`` as ``mmidx.<name>``) must be
importable from the installed package, and the package must not be the source tree itself (an
editable install or the current directory would hide a subpackage missing from the wheel). A module may
fail to import only for a missing optional framework: a package that the installed metadata lists under
an extra (``pip install mmidx[ray]``), or with mmidx's own ``MissingExtraError`` naming an extra the package
declares; never for a module of mmidx or a core dependency.
Exit status 0 when all is well; 1 with one line per problem otherwise.
"""

import importlib
import importlib.metadata
import re
import sys
from pathlib import Path


def source_modules(root: Path) -> list[str]:
    """Names of the modules the source tree defines, packages included."""
    names = []
    for path in sorted((root / "mmidx").rglob("*.py")):
        if path.name == "__main__.py":  # importing it runs the command line
            continue
        parts = path.relative_to(root).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    names += [f"mmidx.{pyx.stem}" for pyx in sorted((root / "csrc").glob("*.pyx"))]
    return names


def optional_packages() -> set[str]:
    """Import names of the packages that only an extra of the installed mmidx requires."""
    optional = set()
    for requirement in importlib.metadata.requires("mmidx") or []:
        if "extra ==" in requirement:
            name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
            optional.add(name.lower().replace("-", "_"))
    return optional


def main(root: Path) -> int:
    import mmidx
    from mmidx.errors import MissingExtraError

    installed = Path(mmidx.__file__).resolve().parent
    if installed.is_relative_to(root.resolve()):
        print(f"mmidx is imported from the source tree ({installed}), not from an installed wheel")
        return 1
    optional, problems, skipped = optional_packages(), [], []
    extras = set(importlib.metadata.metadata("mmidx").get_all("Provides-Extra") or [])
    modules = source_modules(root)
    for name in modules:
        try:
            importlib.import_module(name)
        except MissingExtraError as error:  # mmidx's own line for an optional framework: it names the extra
            extra = re.search(r"mmidx\[(\w+)\]", str(error))
            if extra and extra.group(1) in extras:
                skipped.append(f"{name} (needs the extra {extra.group(1)})")
            else:
                problems.append(f"{name}: {error} (no such extra in the package's metadata)")
        except ModuleNotFoundError as error:
            missing = (error.name or "").split(".")[0]
            if missing in optional:
                skipped.append(f"{name} (needs the optional {missing})")
            else:
                problems.append(f"{name}: {error}")
        except Exception as error:  # any other failure to import is a defect of the package
            problems.append(f"{name}: {type(error).__name__}: {error}")
    for problem in problems:
        print(f"not importable from the installed package: {problem}")
    imported = len(modules) - len(problems) - len(skipped)
    print(f"{imported} of {len(modules)} modules imported from {installed}"
          + (f"; not imported for a missing optional framework: {', '.join(skipped)}" if skipped else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tools/check_installed.py SOURCE_ROOT")
    sys.exit(main(Path(sys.argv[1])))
