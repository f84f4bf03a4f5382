"""What a pack index delivered, phase by phase: ``mixture_report``.

Per phase (the stretch of packs from where it started to where the next one did) and per group: the samples
and tokens the stream took, the achieved share against the requested weight, and per group the epochs
completed and the pack at which each ended — the pack holding the group's ``(e + 1) · n``-th packed sample
(n: its samples). An index of one plain blend has one phase, its tokens counted from the packed samples. A
sample over ``max_num_tokens_per_sample`` is never packed, so a group with excluded
samples ends its epochs later than that count says; the report counts them. ``mmidx index --mixture``
prints it, ``mmidx view`` draws it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mmidx.index.pack_index import PackIndex
from mmidx.index.sizes import view_table
from mmidx.read.dataset import MMIDXDataset


def mixture_report(index: PackIndex, *, share_points: int = 200) -> dict[str, Any]:
    """The report of ``index`` as plain data (see the module doc); ``share_points``: how many points of the
    per-group share over packs (for drawing) — each the share of the packed samples in its stretch of packs."""
    config, stats = index.config, index.stats
    names = [g.name for g in config.groups]
    num_packs = len(index)
    offsets = np.asarray(index.arrays["pack_offsets"], dtype=np.int64)
    samples = np.asarray(index.arrays["samples"], dtype=np.int64)
    group_of_dataset = np.repeat(np.arange(len(names)), [len(g.datasets) for g in config.groups])
    group_of = group_of_dataset[np.searchsorted(index.dataset_starts, samples, side="right") - 1]
    group_starts = np.concatenate([[0], np.cumsum([len(g.datasets) for g in config.groups])])
    sizes = np.diff(index.dataset_starts[group_starts])
    logs = stats.get("mixture") or [{
        "phase": 0, "start_pack": 0, "start_position": 0, "end_position": stats["samples"], "until_packs": None,
        "until_tokens": None, "weights": dict(zip(names, config.phase_weights()[0][0], strict=True)),
        "items": stats["groups"], "tokens": None}]
    phases = []
    for number, log in enumerate(logs):
        end_pack = logs[number + 1]["start_pack"] if number + 1 < len(logs) else num_packs
        tokens = log["tokens"] or _packed_tokens(index, group_of, names)
        items = log["items"]
        total_items, total_weight = sum(items.values()), sum(log["weights"].values())
        phases.append({
            "phase": log["phase"], "packs": [log["start_pack"], end_pack], "stream": [log["start_position"],
                                                                                       log["end_position"]],
            "until": ({"packs": log["until_packs"]} if log["until_packs"] is not None else {})
            | ({"tokens": log["until_tokens"]} if log["until_tokens"] is not None else {}),
            "groups": {name: {"samples": items[name], "tokens": tokens[name],
                              "share": items[name] / total_items if total_items else 0.0,
                              "weight": log["weights"][name] / total_weight} for name in names}})
    epochs = {}
    pack_of_item = np.searchsorted(offsets, np.arange(len(samples)), side="right") - 1
    for group, name in enumerate(names):
        mine = np.flatnonzero(group_of == group)
        ends = mine[sizes[group] - 1::sizes[group]]
        epochs[name] = {"samples": int(sizes[group]), "taken": stats["groups"][name],
                        "completed": stats["groups"][name] // int(sizes[group]),
                        "ended_at_pack": pack_of_item[ends].tolist()}
    return {"packs": num_packs, "excluded": stats["excluded"], "phases": phases, "epochs": epochs,
            "share_over_packs": _share_over_packs(group_of, offsets, len(names), names, share_points)}


def _packed_tokens(index: PackIndex, group_of: np.ndarray, names: list[str]) -> dict[str, int]:
    """Tokens of each group's packed samples, from the view table: an index of one plain blend keeps no
    per-group tokens in its stats (so its cache stays what it always was)."""
    datasets = [[MMIDXDataset(prefix) for prefix in group.datasets] for group in index.config.groups]
    table = view_table(index.config, datasets, index.selections)
    samples = np.asarray(index.arrays["samples"], dtype=np.int64)
    views = np.asarray(index.arrays["views"], dtype=np.int64) if "views" in index.arrays else 0
    tokens = table.tokens_of(samples, views)
    totals = np.bincount(group_of, weights=tokens, minlength=len(names)).astype(np.int64)
    return dict(zip(names, totals.tolist(), strict=True))


def _share_over_packs(group_of: np.ndarray, offsets: np.ndarray, num_groups: int, names: list[str],
                      points: int) -> dict[str, Any]:
    """Each group's share of the packed samples in ``points`` equal stretches of packs."""
    num_packs = len(offsets) - 1
    if num_packs == 0:
        return {"pack": [], "share": {name: [] for name in names}}
    edges = np.unique(np.linspace(0, num_packs, min(points, num_packs) + 1).astype(np.int64))
    per_item = np.repeat(np.arange(len(edges) - 1), np.diff(offsets[edges]))
    counts = np.zeros((len(edges) - 1, num_groups), np.int64)
    np.add.at(counts, (per_item, group_of[offsets[0]:offsets[-1]]), 1)
    share = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    return {"pack": edges[:-1].tolist(), "share": {name: share[:, g].round(4).tolist() for g, name in enumerate(names)}}
