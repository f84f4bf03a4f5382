"""``mmidx inspect`` and the viewer's overview: peak anonymous memory and time, before and after streaming.

Before (``--before``: a checkout whose ``read/checks.py`` took full float64 copies of the index arrays, e.g. main
before issue 55's streaming statistics) and after (this checkout) run on the same synthetic t2i set of one set of
files (:func:`mmidx.toolkit.scale_data.write_synthetic`), interleaved, each a fresh process measured by
:func:`common.measure` (the process tree's peak ``RssAnon``, polled; ``wait4``'s CPU). The sets are deleted after.

    python benchmarks/bench_inspect.py --before /work/main --samples 1000000,10000000
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from common import Watch, measure

REPO = Path(__file__).resolve().parent.parent
OVERVIEW = "import sys; from mmidx.read.dataset import MMIDXDataset; from mmidx.toolkit.view.stats import overview; " \
           "overview(MMIDXDataset(sys.argv[1]))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the checkout to compare with (its mmidx is imported)")
    parser.add_argument("--samples", default="1000000,10000000", help="comma-separated sizes")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    from mmidx.toolkit.scale_data import write_synthetic

    commands = {"inspect": lambda prefix: [sys.executable, "-m", "mmidx.cli", "inspect", prefix],
                "overview": lambda prefix: [sys.executable, "-c", OVERVIEW, prefix]}
    sides = {"before": str(Path(args.before).resolve()), "after": str(REPO)}
    print(f"{'command':<9} {'samples':>11} {'side':<7} {'peak anon MB':>13} {'wall s':>7} {'CPU s':>6}")
    with Watch() as watch:
        for samples in (int(text) for text in args.samples.split(",")):
            work = Path(tempfile.mkdtemp(prefix="bench_inspect_"))
            try:
                prefix = str(work / "t2i")
                write_synthetic(prefix, samples)
                for name, argv in commands.items():
                    best: dict[str, tuple[float, float, float]] = {}
                    for _ in range(args.repeats):
                        for side, path in sides.items():  # interleaved
                            result = measure(argv(prefix), env={**os.environ, "PYTHONPATH": path})
                            assert result.returncode == 0, result.output[-2000:]
                            figures = (result.peak_anon / 1e6, result.wall, result.cpu)
                            best[side] = min(best.get(side, figures), figures)
                    for side, (peak, wall, cpu) in best.items():
                        print(f"{name:<9} {samples:>11,} {side:<7} {peak:>13,.0f} {wall:>7.2f} {cpu:>6.2f}")
                    print(f"{name:<9} {samples:>11,} ratio   {best['before'][0] / best['after'][0]:>12.1f}x "
                          f"{best['before'][1] / best['after'][1]:>6.2f}x")
            finally:
                shutil.rmtree(work)
    print(watch.describe())


if __name__ == "__main__":
    main()
