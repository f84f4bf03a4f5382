"""A uniform random sample of mutmut's mutants, module by module, and the kill ratio it estimates.

mutmut mutates the whole core (over 8,000 mutants: hours on a 2-core machine). When the full run does not fit, a
sample answers how many a test kills, with its uncertainty: from each module, ``max(minimum, fraction × its
mutants)`` names drawn at random (a ``random.Random`` per module, seeded by the seed and the module's name, the
names sorted first, so the same seed and mutants give the same sample, and a module added later leaves the others'
as they were), which ``mutmut run NAME ...`` runs; ``tally`` then reads mutmut's results and prints the table of
docs/development.md and the estimate for the core. The sample as drawn and run is kept in a file
(tests/mutation/sample-48.txt): code changes renumber mutants, so ``tally --sample`` reads the names run, and
``draw --modules`` draws a module added since. Modules are strata of known size: the estimate
weighs each module's ratio by its share of the mutants, and its 95% interval is the normal one of a stratified
sample (each module's variance with the finite-population correction). Mutants listed as equivalent in
tests/mutation/equivalent.md are left out of a module's ratio (no test can tell them from the code). Usage::

    python tools/mutation_sample.py draw > sample.txt      # after mutmut generated its mutants
    nice mutmut run --max-children 2 $(cat sample.txt)
    python tools/mutation_sample.py tally
    python tools/mutation_sample.py draw --modules mmidx.index.sizes >> tests/mutation/sample-48.txt  # a new module
    python tools/mutation_sample.py tally --sample tests/mutation/sample-48.txt
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT = ROOT / "tests" / "mutation" / "equivalent.md"
# mutmut's exit codes (mutmut.stats.status_by_exit_code): 1 and 3 are a failing test; None is not run yet
KILLED = {1, 3}


def mutants_by_module(mutants: Path) -> dict[str, list[str]]:
    """Every mutant's name, by module, from the ``.meta`` files mutmut writes beside the mutated copies."""
    found = {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        names = sorted(json.loads(meta.read_text())["exit_code_by_key"])
        if names:
            found[".".join(meta.relative_to(mutants).with_suffix("").with_suffix("").parts)] = names
    if not found:
        raise SystemExit(f"no mutants under {mutants}: run `mutmut run` once first (it writes them before it runs "
                         "the tests, and may be stopped once it prints 'Running stats')")
    return found


def draw(by_module: dict[str, list[str]], fraction: float, minimum: int, seed: int) -> dict[str, list[str]]:
    """``max(minimum, round(fraction × N))`` names of each module's N (all of them if fewer), at random: each
    module by a generator of its own (seeded by the seed and its name), so that a module added to the core, or
    drawn alone, leaves the other modules' samples as they were."""
    return {module: sorted(random.Random(f"{seed} {module}").sample(
                names, min(len(names), max(minimum, round(fraction * len(names))))))
            for module, names in sorted(by_module.items())}


def read_sample(text: str, by_module: dict[str, list[str]]) -> tuple[dict[str, list[str]], list[str]]:
    """The names of a sample file (one a line; ``#`` starts a comment), by the module whose mutant each is now,
    and those no module has any more (their code changed since the sample was drawn)."""
    owner = {name: module for module, names in by_module.items() for name in names}
    sample: dict[str, list[str]] = {}
    gone = []
    for line in text.splitlines():
        name = line.partition("#")[0].strip()
        if name and name in owner:
            sample.setdefault(owner[name], []).append(name)
        elif name:
            gone.append(name)
    return sample, gone


@dataclass(frozen=True)
class Stratum:
    """One module: its mutants (``size``), those sampled and, of those, the killed and the equivalent ones."""

    module: str
    size: int
    sampled: int
    killed: int
    equivalent: int

    @property
    def ratio(self) -> float:
        """Killed among the sampled mutants that a test could tell from the code."""
        return self.killed / (self.sampled - self.equivalent)


def estimate(strata: Iterable[Stratum]) -> tuple[float, float]:
    """The stratified estimate of the core's kill ratio and the half-width of its 95% interval."""
    strata = list(strata)
    total = sum(s.size for s in strata)  # of the modules tallied
    ratio = sum(s.size / total * s.ratio for s in strata)
    variance = 0.0
    for s in strata:
        n = s.sampled - s.equivalent
        if n > 1:
            variance += ((s.size / total) ** 2 * (1 - s.sampled / s.size) * s.ratio * (1 - s.ratio) / (n - 1))
    return ratio, 1.96 * math.sqrt(variance)


def equivalent_names(text: str) -> set[str]:
    """The mutants named under the headings of ``text`` that begin "Equivalent" (its other lists name survivors
    still to kill, which count as survivors)."""
    return {name for section in re.split(r"^#+ ", text, flags=re.MULTILINE) if section.startswith("Equivalent")
            for name in re.findall(r"`(mmidx\.[^`\s]+__mutmut_\d+)`", section)}


def printed_results(text: str) -> dict[str, int]:
    """Exit codes from what ``mutmut run NAME ...`` prints at its end (a status emoji and a name a line): 1 for a
    killed mutant, 0 for any other outcome (survived, timeout, no tests, a crash)."""
    return {name: int(mark == "\N{PARTY POPPER}")
            for mark, name in re.findall(r"^(\S+) (mmidx\.\S+__mutmut_\d+)$", text, flags=re.MULTILINE)}


def tally(mutants: Path, sample: dict[str, list[str]], equivalent: set[str],
          printed: dict[str, int] | None = None) -> tuple[list[Stratum], dict[str, int]]:
    """Each module's stratum from mutmut's results (in ``mutants/``, or ``printed`` by its runs, which win), and
    the modules left out because some of their sampled mutants have not run (with how many)."""
    strata, not_run = [], {}
    for meta in sorted(mutants.rglob("*.py.meta")):
        module = ".".join(meta.relative_to(mutants).with_suffix("").with_suffix("").parts)
        if module not in sample:
            continue
        kept = json.loads(meta.read_text())["exit_code_by_key"]
        codes = {name: (printed or {}).get(name, code) for name, code in kept.items()}
        names = sample[module]
        missing = sum(codes.get(name) is None for name in names)
        if missing:
            not_run[module] = missing
            continue
        strata.append(Stratum(module, len(codes), len(names), sum(codes.get(name) in KILLED for name in names),
                              sum(name in equivalent for name in names)))
    return strata, not_run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["draw", "tally"])
    parser.add_argument("--fraction", type=float, default=0.04, help="of each module's mutants (default 0.04)")
    parser.add_argument("--minimum", type=int, default=8, help="mutants of each module at least (default 8)")
    parser.add_argument("--seed", type=int, default=48, help="of the draw (default 48, the issue's number)")
    parser.add_argument("--mutants", type=Path, default=ROOT / "mutants", help="mutmut's folder")
    parser.add_argument("--modules", nargs="+", metavar="MODULE", help="draw these modules only (mmidx.index.sizes)")
    parser.add_argument("--sample", type=Path, nargs="+", metavar="FILE",
                        help="tally the names of these files (a sample drawn before, as it was run) instead of a draw")
    parser.add_argument("--printed", type=Path, nargs="+", metavar="LOG",
                        help="what `mutmut run NAME ...` printed, read instead of mutants/ (mutmut drops the results "
                             "it keeps there when its configuration changes); later logs win")
    args = parser.parse_args(argv)
    by_module = mutants_by_module(args.mutants)
    if args.modules:
        unknown = sorted(set(args.modules) - set(by_module))
        if unknown:
            raise SystemExit(f"no mutants of {', '.join(unknown)} under {args.mutants}: name modules as mutmut "
                             f"does ({next(iter(by_module))})")
        by_module = {module: by_module[module] for module in args.modules}
    gone: list[str] = []
    if args.sample and args.command == "tally":
        sample = {}
        for path in args.sample:
            found, missing = read_sample(path.read_text(), by_module)
            gone += missing
            for module, names in found.items():
                sample.setdefault(module, []).extend(names)
    else:
        sample = draw(by_module, args.fraction, args.minimum, args.seed)
    if args.command == "draw":
        print("\n".join(name for names in sample.values() for name in names))
        return 0
    equivalent = equivalent_names(EQUIVALENT.read_text())
    printed = {}
    for log in args.printed or ():
        printed.update(printed_results(log.read_text(errors="replace").replace("\r", "\n")))
    strata, not_run = tally(args.mutants, sample, equivalent, printed)
    if not strata:
        raise SystemExit("no module's sample has run yet: run `mutmut run` with the sample's names")
    print("| module | mutants | sampled | killed | equivalent | survived | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for s in strata:
        print(f"| `{s.module}` | {s.size} | {s.sampled} | {s.killed} | {s.equivalent} | "
              f"{s.sampled - s.killed - s.equivalent} | {s.ratio:.1%} |")
    ratio, half_width = estimate(strata)
    print(f"\nthe core: {sum(s.killed for s in strata)} of {sum(s.sampled for s in strata)} sampled mutants killed "
          f"({sum(s.equivalent for s in strata)} equivalent); estimated kill ratio {ratio:.1%} ± {half_width:.1%} "
          f"(95%, stratified, seed {args.seed}, over the modules above)")
    if not_run:
        print("not run yet (left out): " + ", ".join(f"{module} ({n} of its sample)" for module, n in not_run.items()))
    if gone:
        print(f"no longer mutants of the code (left out): {len(gone)} of the sample's names")
    return 0


if __name__ == "__main__":
    sys.exit(main())
