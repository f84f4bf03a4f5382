"""Balanced steps: each global batch keeps its packs, dealt to (rank, micro-step) by cost; resume across world
sizes stays exact; step_balance matches a direct recomputation and reaches 99% with tight packing."""

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.streams import mix

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index import gpu_time
from mmidx.index.cost import LLMGeometry, pack_costs, step_balance
from mmidx.index.pack_index import build_pack_index
from mmidx.index.packer import pack_samples
from mmidx.index.sizes import view_token_counts
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.train.shares import GlobalBatchSampler
from mmidx.train.state import steps_of_state


def schedule(costs, world_size, global_batch_size, start=0):
    """{rank: [packs in micro-step order]} of a balanced sampler per rank from micro-step ``start``."""
    return {r: list(GlobalBatchSampler(len(costs), global_batch_size=global_batch_size, rank=r,
                                       world_size=world_size, start=start, pack_costs=costs))
            for r in range(world_size)}


@pytest.mark.parametrize("offsets", [[1, 3], [0, 2], [0, 3, 2, 3], np.array([0, 3, 2, 3], np.uint32), [[0, 3]], []])
def test_pack_costs_refuse_offsets_that_do_not_rise_from_0_to_the_segments_saying_so(offsets):
    """Unsigned offsets (an index's, as stored) that fall are refused too, not wrapped round."""
    with pytest.raises(ValueError, match=r"^pack_offsets must rise from 0 to len\(segment_tokens\), one more entry "
                                         r"than packs$"):
        pack_costs(offsets, np.array([5, 6, 7]))
    assert pack_costs([0, 1, 1, 3], np.array([5, 6, 7])).tolist() == pytest.approx(
        [pack_costs([0, 1], [5])[0], 0.0, pack_costs([0, 2], [6, 7])[0]])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0, 100), min_size=0, max_size=200), st.sampled_from([1, 2, 4, 8]),
       st.integers(1, 3))
def test_a_balanced_global_batch_holds_the_same_packs_and_runs_alike_costs_together(costs, world_size, per_rank):
    costs = np.array(costs)
    g = world_size * per_rank
    ranks = schedule(costs, world_size, g)
    for b in range(len(costs) // g):
        packs = sorted(p for r in ranks.values() for p in r[b * per_rank:(b + 1) * per_rank])
        assert packs == list(range(b * g, (b + 1) * g))  # the same set as contiguous shares
        # micro-step j runs the j-th dearest world_size packs (ties: stream order) side by side
        ranked = sorted(range(b * g, (b + 1) * g), key=lambda p: (-costs[p], p))
        for j in range(per_rank):
            together = [ranks[r][b * per_rank + j] for r in range(world_size)]
            assert together == ranked[j * world_size:(j + 1) * world_size]
        for r in range(world_size):  # step_of_pack inverts pack_of_step
            sampler = GlobalBatchSampler(len(costs), global_batch_size=g, rank=r, world_size=world_size,
                                         pack_costs=costs)
            for j in range(per_rank):
                assert sampler.step_of_pack(ranks[r][b * per_rank + j]) == b * per_rank + j


def test_resume_8_then_4_then_1_trains_each_global_batch_exactly_as_an_uninterrupted_run():
    rng = np.random.default_rng(1)
    costs, g = rng.lognormal(0, 1, 64 * 10), 64
    full = {w: schedule(costs, w, g) for w in (8, 4, 1)}
    state = {"packs_consumed": 3 * g, "world_size": 8, "global_batch_size": g}  # 3 optimizer steps at world 8
    four = schedule(costs, 4, g, start=steps_of_state(state, GlobalBatchSampler(len(costs), global_batch_size=g,
                                                                                world_size=4, pack_costs=costs)))
    state = {"packs_consumed": 3 * g + 4 * g, "world_size": 4, "global_batch_size": g}  # then 4 more at world 4
    one = schedule(costs, 1, g, start=steps_of_state(state, GlobalBatchSampler(len(costs), global_batch_size=g,
                                                                               pack_costs=costs)))
    trained = [[full[8][r][b * 8:(b + 1) * 8] for r in range(8)] for b in range(3)]
    trained += [[four[r][b * 16:(b + 1) * 16] for r in range(4)] for b in range(4)]
    trained += [[one[0][b * 64:(b + 1) * 64]] for b in range(len(one[0]) // 64)]
    assert len(trained) == 10
    for b, ranks in enumerate(trained):
        world = len(ranks)
        assert ranks == [full[world][r][b * g // world:(b + 1) * g // world] for r in range(world)]
        assert sorted(p for r in ranks for p in r) == list(range(b * g, (b + 1) * g))


def direct_balance(costs, g, w, balanced):
    """step_balance written out micro-step by micro-step from the samplers themselves."""
    ranks = {r: list(GlobalBatchSampler(len(costs), global_batch_size=g, rank=r, world_size=w,
                                        pack_costs=costs if balanced else None)) for r in range(w)}
    ratios = []
    for step in range(len(ranks[0])):
        side = [costs[ranks[r][step]] for r in range(w)]
        ratios.append(sum(side) / w / max(side))
    return sum(ratios) / len(ratios)


@pytest.mark.parametrize("w,g", [(8, 64), (64, 512)])
def test_tight_balanced_steps_reach_99_percent_and_match_a_direct_recomputation(w, g):
    counts, groups = mix("scale", 60_000 if w == 8 else 240_000)
    packed = pack_samples(counts, groups, mandatory=[False] * 3, policy="tight")
    costs = pack_costs(packed.pack_offsets, counts[packed.pack_items])
    for balanced in (False, True):
        assert step_balance(costs, g, w, balanced=balanced) == pytest.approx(direct_balance(costs, g, w, balanced))
    # measured on this mix with the cost cap: 99.4% (8, 64) and 99.3% (64, 512) balanced, 94-95% contiguous
    assert step_balance(costs, g, w, balanced=True) >= 0.99 > step_balance(costs, g, w, balanced=False)


@pytest.mark.parametrize("kind", ["text", "video"])
def test_the_cost_cap_lifts_balance_to_99_percent_on_the_text_and_video_mixes_too(kind):
    counts, groups = mix(kind, 240_000)
    costs, fills = {}, {}
    for slack in (0.065, None):
        packed = pack_samples(counts, groups, mandatory=[False] * (groups.max() + 1), policy="tight",
                              cost_slack=slack)
        costs[slack] = pack_costs(packed.pack_offsets, counts[packed.pack_items])
        fills[slack] = packed.pack_tokens[:-1].mean() / 36864
    # measured at 240,000 samples, (64, 512): text 98.86% -> 99.34%, video 98.98% -> 99.06%; fill 99.89% and
    # 99.67% (TRL's bfd on the same lengths: 98.35% and 99.60%, benchmarks/bench_packing.py)
    for w, g in ((8, 64), (64, 512)):
        assert step_balance(costs[0.065], g, w, balanced=True) >= 0.99
    assert step_balance(costs[None], 512, 64, balanced=True) < 0.99
    # with one pack per rank (G = W) only the packer can help: the cap lifts it, not to 99%
    assert step_balance(costs[None], 64, 64, balanced=True) < step_balance(costs[0.065], 64, 64, balanced=True) < 0.99
    assert fills[0.065] >= {"text": 0.9835, "video": 0.9960}[kind] and fills[0.065] >= 0.995


def test_index_command_reports_both_policies_as_recomputed_from_the_packs(demo, tmp_path, capsys):
    data_yaml = f"{demo['workdir']}/datasets/data.yaml"
    assert main(["index", data_yaml, "--cache-dir", str(tmp_path), "--world-size", "2", "--global-batch-size",
                 "4", "--num-samples", "3000", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)["gpu_time"]
    config = DataConfig.from_yaml(data_yaml)
    for policy in ("bagel", "tight"):
        index = build_pack_index(replace(config, packing=replace(config.packing, policy=policy)), num_samples=3000,
                                 cache_dir=tmp_path, progress=False)
        # each item's size through the pack reader and each dataset's own view sizes, pack by pack: the index's fill
        sizes = {}
        for g, group in enumerate(index.config.groups):
            for d, prefix in enumerate(group.datasets):
                sizes[g, d] = view_token_counts(MMIDXDataset(prefix), group, index.config.geometry)
        lengths = [[int(sizes[i.group, i.dataset][1][sizes[i.group, i.dataset][0][i.sample] + i.view])
                    for i in index.items(k)] for k in range(len(index))]
        fill = sum(map(sum, lengths)) / len(lengths) / config.packing.max_num_tokens
        # the balance of what the accelerators compute: the built packs' samples, CFG dropout applied
        builder = PackBuilder(index.config, decode_images="device")  # sizes need no pixels
        lengths = [builder.build(k, index.items(k)).sample_lens for k in range(len(index))]
        costs = pack_costs(np.concatenate([[0], np.cumsum([len(x) for x in lengths])]),
                           [n for x in lengths for n in x])
        assert len(lengths) >= 8
        balanced, contiguous = direct_balance(costs, 4, 2, True), direct_balance(costs, 4, 2, False)
        assert balanced != pytest.approx(contiguous)  # the two deals differ on these packs: each figure is checked
        assert report[policy]["fill_vs_max"] == pytest.approx(fill)
        assert report[policy]["step_balance"] == pytest.approx(balanced)
        assert report[policy]["step_balance_contiguous"] == pytest.approx(contiguous)
        assert report[policy]["gpu_efficiency"] == pytest.approx(fill * balanced)


class StubIndex:
    """What packing_efficiency reads of a pack index besides its costs: the fill statistic."""

    def __init__(self, fill):
        self.stats = {"fill_vs_max": fill}


def test_packing_efficiency_is_fill_times_the_balanced_step_balance_with_the_contiguous_one_beside(monkeypatch):
    costs = np.array([5.0, 1.0, 1.0, 1.0, 4.0, 4.0, 2.0, 2.0, 9.0])  # two global batches of 4 at world 2, one left
    asked = []
    monkeypatch.setattr(gpu_time, "pack_index_costs", lambda *arguments: asked.append(arguments) or costs)
    geometry, index = LLMGeometry(hidden_size=8, num_layers=1, ffn_size=4, num_heads=2, num_kv_heads=1), StubIndex(0.9)
    report = gpu_time.packing_efficiency(index, 2, 4, geometry)
    balanced, contiguous = direct_balance(costs[:8], 4, 2, True), direct_balance(costs[:8], 4, 2, False)
    assert balanced != pytest.approx(contiguous)
    assert report == {"fill_vs_max": 0.9, "step_balance": pytest.approx(balanced),
                      "step_balance_contiguous": pytest.approx(contiguous),
                      "gpu_efficiency": pytest.approx(0.9 * balanced)}
    assert asked == [(index, geometry)]


def test_the_gpu_time_report_builds_both_policies_on_the_same_stream_and_refuses_a_batch_the_ranks_cannot_share(
        monkeypatch, tmp_path):
    config = DataConfig.from_dict({"groups": {"t2i": {"datasets": ["unused"]}},
                                   "packing": {"policy": "tight", "window": 7, "max_num_tokens": 60,
                                               "expected_num_tokens": 50, "max_num_tokens_per_sample": 60}})
    built = []

    def build(variant, num_samples, cache_dir, progress):
        built.append((variant, num_samples, cache_dir, progress))
        return StubIndex({"bagel": 0.5, "tight": 0.75}[variant.packing.policy])

    costed = []
    monkeypatch.setattr(gpu_time, "build_pack_index", build)
    monkeypatch.setattr(gpu_time, "pack_index_costs", lambda index, geometry: costed.append(geometry) or np.ones(8))
    geometry = LLMGeometry(hidden_size=8, num_layers=1, ffn_size=4, num_heads=2, num_kv_heads=1)
    report = gpu_time.gpu_time_report(config, 2, 4, num_samples=300, cache_dir=tmp_path, geometry=geometry)
    assert costed == [geometry, geometry]
    assert list(report) == ["bagel", "tight"]
    assert [report[policy]["fill_vs_max"] for policy in report] == [0.5, 0.75]
    assert [variant.packing.policy for variant, *_ in built] == ["tight", "bagel"]  # the config's own first
    for variant, num_samples, cache_dir, progress in built:  # only the policy differs from the config
        assert replace(variant, packing=replace(variant.packing, policy="tight")) == config
        assert (num_samples, cache_dir, progress) == (300, tmp_path, False)
    built.clear()  # the config's own index, given, is priced and not built again
    given = gpu_time.gpu_time_report(config, 2, 4, num_samples=300, cache_dir=tmp_path, geometry=geometry,
                                     index=StubIndex(0.75))
    assert given == report and [variant.packing.policy for variant, *_ in built] == ["bagel"]
    assert gpu_time.gpu_time_report(config, 1, 1)["tight"]["step_balance"] == 1.0  # the smallest run: one rank
    for world_size, global_batch_size in ((0, 4), (2, 0), (2, 3), (-1, -2)):
        with pytest.raises(ValueError, match=re.escape(f"the global batch size ({global_batch_size}) must be a "
                                                       f"positive multiple of the world size ({world_size})")):
            gpu_time.gpu_time_report(config, world_size, global_batch_size)
