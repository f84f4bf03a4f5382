"""What a build did: per-unit counts, their sum, skip and warning examples, and the verdict.

Counts are plain JSON dicts so that shard reports (``report.json`` of each shard), the build report
(``OUTPUT.report.json``) and the reports that cross process and node boundaries are the same thing.
The verdict is judged from the counts and the limit given *now*, so a rerun with another
limit (``max_skip_rate``, ``mmidx build --max-skip-rate``) is judged by that limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmidx.errors import option
from mmidx.fetch.outcomes import failure_warning
from mmidx.format import report_path as report_path  # where the report lives, beside its dataset
from mmidx.sources import SKIP_REASONS, WARNING_REASONS, Skip

EXAMPLES_PER_REASON = 5
_TOTALS = ("rows", "samples", "skipped", "warned", "views", "images", "tokens")


def new_counts() -> dict[str, Any]:
    return {**dict.fromkeys(_TOTALS, 0), "skips": {}, "warnings": {}, "seconds": {}}


def row_example(path: str, row: int, detail: str, line_based: bool) -> dict[str, Any]:
    """Where a row is: line-based inputs by 1-based line number (as editors show them), others by row."""
    where = {"line": row + 1} if line_based else {"row": row}
    return {"file": path, **where, "detail": detail[:500]}


def _count(table: dict[str, Any], reason: str, example: dict[str, Any]) -> None:
    entry = table.setdefault(reason, {"count": 0, "examples": []})
    entry["count"] += 1
    if len(entry["examples"]) < EXAMPLES_PER_REASON:
        entry["examples"].append(example)


def count_skip(counts: dict[str, Any], skip: Skip, path: str, line_based: bool) -> None:
    _count(counts["skips"], skip.reason, row_example(path, skip.row, skip.detail, line_based))
    counts["skipped"] += 1


def count_warning(counts: dict[str, Any], reason: str, row: int, detail: str, path: str, line_based: bool) -> None:
    _count(counts["warnings"], reason, row_example(path, row, detail, line_based))
    counts["warned"] += 1


def add_counts(total: dict[str, Any], part: dict[str, Any]) -> None:
    for key in _TOTALS:
        total[key] += part[key]
    for table in ("skips", "warnings"):
        for reason, entry in part[table].items():
            into = total[table].setdefault(reason, {"count": 0, "examples": []})
            into["count"] += entry["count"]
            into["examples"] = (into["examples"] + entry["examples"])[:EXAMPLES_PER_REASON]
    for what, seconds in part["seconds"].items():
        total["seconds"][what] = total["seconds"].get(what, 0.0) + seconds


def counted(count: int, word: str) -> str:
    """``count`` and ``word`` in its right number: "1 unit", "2 units", "1,024 samples"."""
    return f"{count:,} {word}" if count == 1 else f"{count:,} {word}s"


def judge(data: dict[str, Any], max_skip_rate: float) -> dict[str, Any]:
    """``data`` (summed counts) with ``ok``, ``message``, ``skip_rate`` and ``max_skip_rate`` set by this limit."""
    rows, samples = data["rows"], data["samples"]
    skip_rate = data["skipped"] / rows if rows else 0.0
    if samples == 0:
        ok, message = False, (f"nothing was built from {counted(rows, 'row')}, so no dataset was written; see the skip "
                              "reasons above" if rows else "the inputs hold no rows, so no dataset was written")
    elif skip_rate > max_skip_rate:
        ok, message = False, (f"{skip_rate:.2%} of the rows were skipped, more than {option('max_skip_rate')} "
                              f"{max_skip_rate:.2%}; the dataset was written, but check the inputs")
    else:
        ok, message = True, f"skipped {skip_rate:.2%} of the rows (limit {max_skip_rate:.2%})"
    return {**data, "skip_rate": skip_rate, "max_skip_rate": max_skip_rate, "ok": ok, "message": message}


def _where(example: dict[str, Any]) -> str:
    where = f"line {example['line']}" if "line" in example else f"row {example.get('row')}"
    return f"{example.get('file')} {where}: {example.get('detail')}"


@dataclass
class BuildReport:
    """What a build did: counts, skips and warnings by reason with examples, timings, and whether it passed."""

    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.data["ok"])

    @property
    def message(self) -> str:
        return self.data["message"]

    def summary(self) -> str:
        """A few human-readable lines: what was built, what was skipped or warned about and why."""
        d = self.data
        built = (f"{counted(d['samples'], 'sample')} ({counted(d['views'], 'view')}, {counted(d['images'], 'image')}, "
                 f"{counted(d['tokens'], 'token')})")
        if "datasets" in d:  # whole datasets merged: no rows or work units, only their samples
            lines = [f"{d['output']}: {built} from {counted(d['datasets'], 'dataset')} in "
                     f"{d['seconds'].get('wall', 0):.1f} s"]
        else:
            lines = [f"{d['output']}: {built} from {counted(d['rows'], 'row')} "
                     f"{'built earlier ' if d.get('already_built') else ''}in {d['seconds'].get('wall', 0):.1f} s; "
                     f"{counted(d['units'], 'unit')}, {d['reused_units']:,} reused"]
        for kind, table, reasons in (("skipped", "skips", SKIP_REASONS), ("warning:", "warnings", WARNING_REASONS)):
            for reason, entry in sorted(d.get(table, {}).items(), key=lambda item: -item[1]["count"]):
                example = f" (e.g. {_where(entry['examples'][0])})" if entry["examples"] else ""
                lines.append(f"  {kind} {entry['count']:,} × {reason}: {reasons.get(reason, '')}{example}")
        if warning := failure_warning(d):
            lines.append(warning)
        lines.append(("OK: " if self.ok else "FAILED: ") + self.message)
        return "\n".join(lines)

