"""inspect's and the viewer's statistics in one streaming pass: equal to whole-array numpy, at any chunk size,
and the same on a sharded dataset as on one set of files holding the same samples."""

from __future__ import annotations

import numpy as np
import pytest

from mmidx import format as fmt
from mmidx.read import statistics
from mmidx.read.checks import summary
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.statistics import Distribution
from mmidx.toolkit.scale_data import write_synthetic
from mmidx.toolkit.view.stats import overview


def reference(values: np.ndarray) -> dict[str, float]:
    """The statistics as numpy gives them on every value at once (what inspect computed before)."""
    values = np.asarray(values, dtype=np.float64)
    if len(values) == 0:
        return {"count": 0}
    p50, p99 = np.percentile(values, [50, 99])
    return {"count": len(values), "min": float(values.min()), "mean": round(float(values.mean()), 2),
            "p50": float(p50), "p99": float(p99), "max": float(values.max())}


@pytest.mark.parametrize("seed", range(20))
def test_a_distribution_added_in_pieces_gives_numpys_statistics_of_the_whole(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 3000))
    high = int(rng.choice([2, 50, 70_000, 2**40]))
    values = rng.integers(0, high, n, dtype=np.int64)
    cuts = np.sort(rng.integers(0, n, int(rng.integers(0, 6))))
    distribution = Distribution()
    for piece in np.split(values, cuts):
        distribution.add(piece)
    assert distribution.stats() == reference(values)
    assert distribution.total == int(values.sum())
    for q in (0, 1, 25, 50, 75, 99, 100):
        assert distribution.percentile(q) == float(np.percentile(values.astype(np.float64), q))


def test_an_empty_distribution_has_count_zero():
    assert Distribution().stats() == {"count": 0}


@pytest.fixture(scope="module")
def single_and_sharded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stats")
    write_synthetic(folder / "one", 2000)
    write_synthetic(folder / "sharded", 2000, shards=3)
    return MMIDXDataset(folder / "one"), MMIDXDataset(folder / "sharded")


@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_inspect_streams_to_numpys_whole_array_statistics_and_a_sharded_set_gives_the_same(
        single_and_sharded, monkeypatch, chunk):
    monkeypatch.setattr(statistics, "CHUNK", chunk)
    single, sharded = single_and_sharded
    found, found_sharded = summary(single), summary(sharded)
    tokens, plan = single.tokens, single.plan
    per_sample = np.diff(np.concatenate([[0], np.cumsum(tokens.sequence_lengths, dtype=np.int64)])
                         [tokens.document_indices])
    assert found["tokens_per_sequence"] == reference(tokens.sequence_lengths)
    assert found["tokens_per_sample"] == reference(per_sample)
    assert found["views_per_sample"] == reference(np.diff(plan["sample_view_offsets"]))
    assert found["elements_per_view"] == reference(np.diff(plan["view_element_offsets"]))
    assert found["images"]["bytes"] == reference(np.diff(plan["image_offsets"]))
    assert found["images"]["width"] == reference(plan["image_info"]["width"])
    assert found["images"]["height"] == reference(plan["image_info"]["height"])
    assert found["tokens"] == int(tokens.sequence_lengths.sum()) and found["images"]["count"] == len(plan["image_info"])
    assert sum(found["images"]["formats"].values()) == len(plan["image_info"])
    elements = plan["elements"]
    for code, name in enumerate(fmt.KIND_NAMES):
        mine = elements["kind"] == code
        assert found["element_kinds"][name] == {
            "count": int(mine.sum()), "loss": int((mine & (elements["flags"] & fmt.FLAG_LOSS != 0)).sum()),
            "enable_cfg": int((mine & (elements["flags"] & fmt.FLAG_ENABLE_CFG != 0)).sum())}
    for key in ("prefix", "format_version", "files"):
        del found[key], found_sharded[key]
    assert found_sharded == found


@pytest.mark.parametrize("chunk", [3, 1 << 20])
def test_the_viewers_overview_of_a_sharded_set_equals_that_of_one_set_of_files(single_and_sharded, monkeypatch, chunk):
    monkeypatch.setattr(statistics, "CHUNK", chunk)
    single, sharded = single_and_sharded
    found, found_sharded = overview(single), overview(sharded)
    for key in ("format_version", "bytes", "build", "report"):
        found.pop(key), found_sharded.pop(key)
    assert found_sharded == found
    charts = {chart.title: chart for chart in found["histograms"]}
    assert charts["tokens per sample"].total == len(single)
    assert charts["image width (stored pixels)"].total == found["images"] == len(single.plan["image_info"])
