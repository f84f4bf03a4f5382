"""What a data config's packs waste of GPU time: ``gpu_time_report`` (``mmidx index --world-size W
--global-batch-size G``), for the config's packing policy and the other one on the same stream.

- ``fill_vs_max``: mean pack tokens ÷ ``max_num_tokens`` (the pack index's statistic);
- ``step_balance``: :func:`mmidx.index.cost.step_balance` of the packs' costs after CFG dropout (what the
  accelerators compute, :func:`~mmidx.index.pack_index.pack_index_costs`), dealt by them (balanced steps, as the
  loaders deal) and as contiguous shares (``step_balance_contiguous``);
- ``gpu_efficiency``: ``fill_vs_max × step_balance``.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from mmidx.config import DataConfig
from mmidx.index.cost import LLMGeometry, step_balance
from mmidx.index.pack_index import PackIndex, build_pack_index, pack_index_costs


def packing_efficiency(index: PackIndex, world_size: int, global_batch_size: int,
                       geometry: LLMGeometry | None = None) -> dict[str, float]:
    """fill_vs_max, step_balance (balanced and contiguous) and gpu_efficiency of one pack index."""
    costs = pack_index_costs(index, geometry)
    fill = float(index.stats["fill_vs_max"])
    balance = step_balance(costs, global_batch_size, world_size, balanced=True)
    return {"fill_vs_max": fill, "step_balance": balance,
            "step_balance_contiguous": step_balance(costs, global_batch_size, world_size, balanced=False),
            "gpu_efficiency": fill * balance}


def gpu_time_report(config: DataConfig, world_size: int, global_batch_size: int, *, num_samples: int | None = None,
                    cache_dir: str | os.PathLike | None = None, geometry: LLMGeometry | None = None,
                    index: PackIndex | None = None) -> dict[str, dict[str, float]]:
    """{policy: packing_efficiency} for ``config``'s policy and the other one, on the same stream. ``index``: the
    index of ``config`` (and ``num_samples``) built already, priced rather than built again; the other policy's is
    built after it is priced, so no more than two indices are held at once."""
    if world_size < 1 or global_batch_size < 1 or global_batch_size % world_size:
        raise ValueError(f"the global batch size ({global_batch_size}) must be a positive multiple of the world "
                         f"size ({world_size})")
    report: dict[str, Any] = {}
    policies = ("bagel", "tight")
    for policy in sorted(policies, key=lambda name: name != config.packing.policy):  # the config's own first
        if index is None or policy != config.packing.policy:
            variant = dataclasses.replace(config, packing=dataclasses.replace(config.packing, policy=policy))
            index = None  # let go of the last index before the next is built
            index = build_pack_index(variant, num_samples=num_samples, cache_dir=cache_dir, progress=False)
        report[policy] = packing_efficiency(index, world_size, global_batch_size, geometry)
    return {policy: report[policy] for policy in policies}
