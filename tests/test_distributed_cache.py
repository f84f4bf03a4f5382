"""The index cache's entries (arrays as built, a failed build's own error), and under torch.distributed: rank 0
builds a cached index and the other ranks wait and map the same files."""

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import mmidx.index.cache
from mmidx.index.cache import cached_arrays, cached_build


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


def test_a_cached_array_of_rows_is_mapped_with_its_shape_built_and_reused(tmp_path):
    rows = np.arange(24, dtype=np.int32).reshape(8, 3)

    def build(sink):
        sink.declare("rows", np.int32, (3,))
        sink.append("rows", rows[:5])
        sink.append("rows", rows[5:])
        return {}

    for reused in (False, True):
        arrays, _, _, was_reused = cached_build(tmp_path, {"kind": "rows"}, build)
        assert was_reused == reused and arrays["rows"].shape == (8, 3)
        np.testing.assert_array_equal(arrays["rows"], rows)


def test_a_description_and_stats_json_cannot_hold_are_recorded_as_their_text(tmp_path):
    """Paths in a description and numpy numbers in stats (what builds hand over) are written as text, as the
    entry's key hashes them, not refused after the build."""
    description = {"prefix": Path("/data/t2i"), "size": np.int64(4)}
    arrays, stats, folder = cached_arrays(tmp_path, description, lambda: ({"values": np.arange(4)},
                                                                          {"num_packs": np.int64(4)}))
    assert json.loads((folder / "index.json").read_text())["description"] == {"prefix": "/data/t2i", "size": "4"}
    assert stats == {"num_packs": "4"} and arrays["values"].tolist() == [0, 1, 2, 3]
    assert folder.name == mmidx.index.cache.description_key(description)


def test_a_failed_build_raises_its_own_error_when_the_cache_folder_was_cleared_meanwhile(tmp_path):
    cache = tmp_path / "cache"

    def build(sink):
        sink.declare("values", np.int64)
        shutil.rmtree(cache)  # a user's `rm -rf` of the cache while the build runs
        raise MemoryError("the build's own error")

    with pytest.raises(MemoryError, match="the build's own error"):
        cached_build(cache, {"kind": "cleared"}, build)
    assert not cache.exists()
