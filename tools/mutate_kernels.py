"""Mutation testing of the packing kernel (csrc/_packing.pyx), which mutmut cannot reach (it mutates Python).

Each mutation of a fixed list (an operator or a boundary in the window, the cost cap, the mandatory items and the
phase limits) is applied alone to a scratch copy of the repository, built in place there with setup.py (the same
compiler directives as a release), and the kernel's tests run against it under the suite's per-test timeout. The
source tree is never changed (hypothesis runs its ``mutation`` profile, tests/conftest.py: a failing example is
reported as found, not shrunk). Each mutation ends as one of:

- ``killed``: a test failed on an assertion (or an error the code raised);
- ``timeout``: only the per-test timeout (or, for a loop that holds the GIL, this script's own limit) stopped it:
  a hang, which the suite must not need to see a bug;
- ``survived``: every test passed.

The kernel's tests must kill every mutation by an assertion: the script exits 1 otherwise. Usage (about a minute
per mutation on 2 quiet cores; ``--only NAME`` for some)::

    nice python tools/mutate_kernels.py [--only NAME ...] [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = "csrc/_packing.pyx"
# The kernel's tests, fastest to kill first (pytest stops at the first failure).
TESTS = ["tests/test_tight_reference.py", "tests/test_packing_reference.py", "tests/test_tight_packing.py",
         "tests/test_index_packing.py", "tests/test_mixtures.py", "tests/test_pack_stream.py"]
RUN_LIMIT = 1800  # seconds for one mutation's tests: past it the run is a hang that held the GIL


@dataclass(frozen=True)
class Mutation:
    """``before`` (found exactly once in the kernel) replaced by ``after``."""

    name: str
    before: str
    after: str


MUTATIONS = [
    # the window: packs close while it holds `window` items; seeds in stream order under half the cap
    Mutation("window-wider", "while self.buffer.size >= self.window:", "while self.buffer.size > self.window:"),
    Mutation("seed-below-or-at-half", "while b.first >= 0 and self.pack_sum < self.seed_below:",
             "while b.first >= 0 and self.pack_sum <= self.seed_below:"),
    Mutation("seed-half-to-quarter", "self.seed_below = max_num_tokens // 2", "self.seed_below = max_num_tokens // 4"),
    Mutation("seed-fits-strictly", "if self.pack_sum + b.count[node] > self.max_num_tokens or (seeded",
             "if self.pack_sum + b.count[node] >= self.max_num_tokens or (seeded"),
    Mutation("largest-fitting-later-among-equals", "(best < 0 or b.count[node] > b.count[best])",
             "(best < 0 or b.count[node] >= b.count[best])"),
    # the cost cap
    Mutation("first-seed-under-the-cap", "(seeded and self._over_cost_cap(b.count[node]))",
             "self._over_cost_cap(b.count[node])"),
    Mutation("cap-reached-is-over", "self.pack_cost + self._cost(count) > self.cost_cap",
             "self.pack_cost + self._cost(count) >= self.cost_cap"),
    Mutation("cap-slack-remainder-dropped",
             "full + full // 10000 * self.cost_slack + full % 10000 * self.cost_slack // 10000",
             "full + full // 10000 * self.cost_slack"),
    Mutation("cap-leak-halved", "self.stream_tokens += count - (self.stream_tokens >> 12)",
             "self.stream_tokens += count - (self.stream_tokens >> 11)"),
    Mutation("cap-tokens-within-one-short", "while n < self.max_num_tokens and self._cost(n + 1) <= budget:",
             "while n < self.max_num_tokens and self._cost(n + 1) < budget:"),
    Mutation("cap-capped-packs-uncounted", "self.cost_capped_packs += 1", "pass"),
    # mandatory items
    Mutation("mandatory-removed-from-tight",
             "        needed = self._place_mandatory()\n        if needed >= 0:\n            return needed\n"
             "        self.mandatory_next = 0\n        while b.first",
             "        needed = -1\n        if needed >= 0:\n            return needed\n"
             "        self.mandatory_next = 0\n        while b.first"),
    Mutation("mandatory-buffered-fits-strictly",
             "if self.pack_sum + self.buffer.count[node] <= self.max_num_tokens:",
             "if self.pack_sum + self.buffer.count[node] < self.max_num_tokens:"),
    Mutation("mandatory-queued-fits-strictly", "if self.pack_sum + q.count[q.head] <= self.max_num_tokens:",
             "if self.pack_sum + q.count[q.head] < self.max_num_tokens:"),
    Mutation("mandatory-popped-one-short", "self.popped[m] = q.rank[q.head] + 1", "self.popped[m] = q.rank[q.head]"),
    Mutation("restart-after-reached-only", "self.fed[m] = max(self.seen[m], self.popped[m])",
             "self.fed[m] = self.seen[m]"),
    Mutation("restart-after-taken-only", "self.fed[m] = max(self.seen[m], self.popped[m])",
             "self.fed[m] = self.popped[m]"),
    Mutation("restart-one-late", "self.fed[m] = max(self.seen[m], self.popped[m])",
             "self.fed[m] = max(self.seen[m], self.popped[m]) + 1"),
    # a schedule's phase limits
    Mutation("phase-packs-limit-late", "(stop_packs >= 0 and self.num_packs >= stop_packs)",
             "(stop_packs >= 0 and self.num_packs > stop_packs)"),
    Mutation("phase-tokens-limit-late", "(stop_tokens >= 0 and self.tokens >= stop_tokens)",
             "(stop_tokens >= 0 and self.tokens > stop_tokens)"),
    # the bagel policy's buffer bound
    Mutation("bagel-buffer-one-more",
             "or self.buffer.size > self.max_buffer_size:\n                        self._close()",
             "or self.buffer.size > self.max_buffer_size + 1:\n                        self._close()"),
]


def scratch_copy(destination: Path) -> None:
    """The repository's files as they are now (tracked and untracked, not ignored), without built outputs."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)


def build(copy: Path) -> None:
    """Build the kernels in place in ``copy`` (only those whose source changed, after the first build)."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-j", "2"], cwd=copy,
                          capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the build failed in {copy}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")


def run_tests(copy: Path) -> tuple[str, str]:
    """(outcome, the failing test's line) of the kernel's tests in ``copy``, stopping at the first failure."""
    # the suite's per-test timeout (pyproject.toml); a failing property is reported as hypothesis found it, not
    # shrunk (shrinking reruns the test many times, which could pass the timeout on a loaded machine)
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "--hypothesis-profile=mutation", *TESTS]
    environment = {**os.environ, "PYTHONPATH": str(copy), "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(command, cwd=copy, env=environment, capture_output=True, text=True, timeout=RUN_LIMIT)
    except subprocess.TimeoutExpired:
        return "timeout", f"no result in {RUN_LIMIT} s (a loop holding the GIL)"
    output = done.stdout + done.stderr
    if done.returncode == 0:
        return "survived", ""
    failed = next((line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
    if "+ Timeout +" in output:  # the timeout's thread dumped the stacks and ended the process
        stuck = re.findall(r'File "[^"]*/(tests/test_\w+\.py)", line \d+, in (test_\w+)', output)
        return "timeout", "::".join(stuck[0]) if stuck else "the per-test timeout"
    return "killed", failed or output.strip().splitlines()[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="these mutations only")
    parser.add_argument("--keep", type=Path, help="build in this folder and keep it (default: a temporary one)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"no mutation named {', '.join(sorted(unknown))}")
    original = (ROOT / KERNEL).read_text()
    for mutation in chosen:
        if original.count(mutation.before) != 1:
            raise SystemExit(f"{mutation.name}: its text is found {original.count(mutation.before)} times in "
                             f"{KERNEL}, not once: update the mutation to the kernel")
    copy = args.keep or Path(tempfile.mkdtemp(prefix="mmidx-kernel-mutants-"))
    copy.mkdir(parents=True, exist_ok=True)
    try:
        scratch_copy(copy)
        print(f"building the kernels in {copy} ...", flush=True)
        build(copy)
        outcomes = {}
        for mutation in chosen:
            start = time.monotonic()
            (copy / KERNEL).write_text(original.replace(mutation.before, mutation.after))
            build(copy)
            outcome, detail = run_tests(copy)
            outcomes[mutation.name] = outcome
            print(f"{mutation.name:40s} {outcome:9s} {time.monotonic() - start:6.0f} s  {detail}", flush=True)
        (copy / KERNEL).write_text(original)
    finally:
        if args.keep is None:
            shutil.rmtree(copy, ignore_errors=True)
    tally = {outcome: sum(o == outcome for o in outcomes.values()) for outcome in ("killed", "timeout", "survived")}
    print(f"killed by an assertion: {tally['killed']}/{len(outcomes)}; by the timeout only: {tally['timeout']}; "
          f"survived: {tally['survived']}")
    killed = tally["killed"]
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
