"""Under torch.distributed, rank 0 builds a cached index and the other ranks wait and map the same files."""

import json
import os

import torch.distributed as dist
import torch.multiprocessing as mp

import mmidx.index.cache
from mmidx.index.cache import cached_arrays


def _rank(rank: int, world: int, store: str, cache: str, results: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    built = []

    def build():
        import numpy as np

        built.append(rank)
        return {"values": np.arange(1000) * 7}, {"built_by": rank}

    arrays, stats, folder = cached_arrays(cache, {"kind": "test", "size": 1000}, build)
    with open(os.path.join(results, f"{rank}.json"), "w") as stream:
        json.dump({"built": built, "stats": stats, "folder": str(folder), "sum": int(arrays["values"].sum())}, stream)
    dist.barrier()
    dist.destroy_process_group()


def test_only_rank_0_builds_and_every_rank_reads_the_same_arrays(tmp_path):
    world = 3
    results = tmp_path / "results"
    results.mkdir()
    mp.spawn(_rank, args=(world, str(tmp_path / "store"), str(tmp_path / "cache"), str(results)), nprocs=world)
    reports = [json.loads((results / f"{rank}.json").read_text()) for rank in range(world)]
    assert [r["built"] for r in reports] == [[0], [], []]
    assert {r["stats"]["built_by"] for r in reports} == {0}
    assert len({r["folder"] for r in reports}) == 1 and {r["sum"] for r in reports} == {7 * 999 * 1000 // 2}
    assert not any(".partial" in name.name for name in (tmp_path / "cache").iterdir())
    assert mmidx.index.cache.description_key({"kind": "test", "size": 1000}) in reports[0]["folder"]
