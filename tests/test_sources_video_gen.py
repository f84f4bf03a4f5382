"""video_gen: plans as BAGEL's _add_video writes them, cut into random groups; frames as PyAV decodes them;
packs whose timesteps, rope ids and masks are diffusion forcing's; grouping draws as split_integer_exp_decay's."""

import collections
import itertools
import json
import math
import random

import numpy as np
import pytest
import torch
from support.bagel_reference import pack as reference_pack
from support.bagel_video import add_video, composition_probability
from support.bagel_video import split_integer_exp_decay as bagel_split
from support.sources import build, decoded, image_bytes, pyav_frames, tokenizer_dir, write_jsonl, write_mp4

from mmidx.cli import main
from mmidx.config import DataConfig
from mmidx.index.dropout import sample_randomness
from mmidx.index.pack_index import PackItem
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.grouping import split_integer_exp_decay
from mmidx.toolkit.show import (
    BOUNDARY_COLOUR,
    COLOURS,
    LEFT,
    LINE,
    LOSS_BAR,
    STRIP,
    TOP_LABELS,
    render,
    split_labels,
    split_scaled_edges,
)
from mmidx.toolkit.show import token_kinds as kinds_of

VIEWS, MIN_FRAMES, MAX_FRAMES = 4, 4, 6
VAE = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
GEOMETRY = {"vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16, "max_latent_size": 64}
FOLDER_FRAMES = 8
GOOD_ROWS = [  # (row, condition frames); samples 0..3 in this order
    {"video": "long.mp4", "caption": "a red car on the river"},
    {"video": "long.mp4", "caption": {"0": "sky", "1": "a tree in the sky"}, "condition_frames": 2},
    {"video": "frames/", "caption": "a house", "condition_frames": 1},
    {"video": "short.mp4", "caption": "a dog", "condition_frames": 1},  # 3 frames: draws padded with the last
]
BAD_ROWS = [
    ({"video": "long.mp4", "caption": "cat", "condition_frames": MAX_FRAMES}, "no_target_frames"),  # all conditioning
    ({"video": "long.mp4", "caption": "cat", "condition_frames": 9}, "no_target_frames"),  # more than drawn
    ({"video": "long.mp4", "caption": ["a", "list"]}, "bad_captions"),
    ({"video": "long.mp4", "caption": "cat", "condition_frames": "2"}, "malformed_record"),
    ({"video": "missing.mp4", "caption": "cat"}, "missing_file"),
]


def _build(folder, name, rows, *flags):
    path = write_jsonl(folder / f"{name}.jsonl", rows)
    argv = ["build", "--source", "video_gen", "--input", path, "--image-root", str(folder / "clips"),
            "--tokenizer", tokenizer_dir(), "--output", str(folder / name), "--views", str(VIEWS),
            "--min-frames", str(MIN_FRAMES), "--max-frames", str(MAX_FRAMES), "--max-skip-rate", "1", "--quiet",
            *flags]
    assert main(argv) == 0
    return MMIDXDataset(folder / name), json.loads((folder / f"{name}.report.json").read_text())


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video_gen")
    (folder / "clips" / "frames").mkdir(parents=True)
    write_mp4(folder / "clips" / "long.mp4", 30)
    write_mp4(folder / "clips" / "short.mp4", 3)
    for i in range(FOLDER_FRAMES):
        (folder / "clips" / "frames" / f"frame_{i}.jpg").write_bytes(image_bytes(64, 48, seed=i))
    grouped = _build(folder, "grouped", GOOD_ROWS + [row for row, _ in BAD_ROWS])
    plain = _build(folder, "plain", GOOD_ROWS, "--no-grouping")
    return {"folder": folder, "grouped": grouped, "plain": plain,
            "pyav": {name: pyav_frames(folder / "clips" / name) for name in ("long.mp4", "short.mp4")}}


def frame_numbers(sample, view):
    numbers = sample.extra["video_frames"]
    return [numbers[e["payload"]] for e in sample.sequence_plan(view) if e["type"] == "vae_image"]


def bagel_keys(plan):
    return [{k: v for k, v in item.items() if k not in ("payload", "img_num")} for item in plan]


def target_groups(plan, condition):
    """Sizes of the target splits, read from the split_start flags of the target frames."""
    starts = [i for i, item in enumerate(plan[1 + condition:]) if item["split_start"]] + [len(plan) - 1 - condition]
    return [b - a for a, b in itertools.pairwise(starts)]


TEXT = {"type": "text", "enable_cfg": 1, "loss": 0, "special_token_loss": 0, "special_token_label": None,
        "split_start": True, "split_end": True}


def expected_plan(numbers, condition, sizes):
    """Caption, _add_video(need_vae) of the conditioning frames, _add_video(need_loss) of each group, where a
    group's last frame keeps its frame_delta to the next group's first (video_gen's documented choice)."""
    plan = [dict(TEXT)] + (add_video(numbers[:condition], False, True) if condition else [])
    targets, first = numbers[condition:], 0
    for size in sizes:
        group = add_video(targets[first:first + size], True, False)
        first += size
        if first < len(targets):
            group[-1]["frame_delta"] = targets[first] - targets[first - 1]
        plan += group
    return plan


def test_every_view_is_the_caption_then_clean_conditioning_then_noised_groups(clips):
    dataset, _ = clips["grouped"]
    assert len(dataset) == len(GOOD_ROWS)
    sizes_seen = []
    for index, row in enumerate(GOOD_ROWS):
        sample, condition = dataset[index], row.get("condition_frames", 0)
        assert sample.extra["condition_frames"] == condition
        for view in range(VIEWS):
            plan, numbers = sample.sequence_plan(view), frame_numbers(sample, view)
            assert MIN_FRAMES <= len(numbers) <= MAX_FRAMES and numbers == sorted(numbers)
            sizes = target_groups(plan, condition)
            assert sum(sizes) == len(numbers) - condition and min(sizes) >= 1
            assert bagel_keys(plan) == expected_plan(numbers, condition, sizes)
            assert all(item["img_num"] == 1 for item in plan)
            sizes_seen.append(tuple(sizes))
    assert any(len(sizes) == 1 for sizes in sizes_seen) and any(len(sizes) >= 3 for sizes in sizes_seen)
    assert len(set(sizes_seen)) > VIEWS  # groups are drawn per view


def test_captions_are_strings_or_bagels_caption_dict_every_one_shown_before_repeats(clips):
    dataset, _ = clips["grouped"]
    sample = dataset[1]
    shown = [sample.texts[sample.sequence_plan(view)[0]["payload"]].tolist() for view in range(VIEWS)]
    assert sorted(map(tuple, shown[:2])) == sorted(map(tuple, (t.tolist() for t in sample.texts)))
    assert len(sample.texts) == 2 and len(dataset[0].texts) == 1


def test_no_grouping_plans_are_exactly_what_add_video_writes_for_the_same_frames(clips):
    dataset, report = clips["plain"]
    assert report["samples"] == len(GOOD_ROWS)
    for index, row in enumerate(GOOD_ROWS):
        condition = row.get("condition_frames", 0)
        for view in range(VIEWS):
            sample = dataset[index]
            numbers = frame_numbers(sample, view)
            bagel = [dict(TEXT)] + (add_video(numbers[:condition], False, True) if condition else [])
            bagel += add_video(numbers[condition:], True, False)
            assert bagel_keys(sample.sequence_plan(view)) == bagel


def test_stored_frames_equal_pyavs_decode_and_folder_frames_are_stored_as_they_are(clips):
    dataset, _ = clips["grouped"]
    for index, row in enumerate(GOOD_ROWS):
        sample = dataset[index]
        numbers = sample.extra["video_frames"]
        assert len(numbers) == len(sample.images) == len(set(numbers))  # each frame stored once
        for number, image in zip(numbers, sample.images, strict=True):
            if row["video"].endswith("/"):
                path = clips["folder"] / "clips" / "frames" / f"frame_{number}.jpg"
                assert bytes(image.data) == path.read_bytes()
            else:
                assert np.array_equal(decoded(image.data), clips["pyav"][row["video"]][number])


def test_rows_that_cannot_make_a_plan_are_counted_skips_with_a_clear_reason(clips):
    _, report = clips["grouped"]
    expected = collections.Counter(reason for _, reason in BAD_ROWS)
    assert {reason: entry["count"] for reason, entry in report["skips"].items()} == expected
    details = [example["detail"] for example in report["skips"]["no_target_frames"]["examples"]]
    assert any(f"condition_frames={MAX_FRAMES} leaves no frame to generate" in d for d in details)
    assert any("condition_frames=9" in d and "lower condition_frames or raise --min-frames" in d for d in details)


def test_a_one_frame_clip_is_a_t2i_sample_and_a_conditioning_only_one_is_skipped(clips, tmp_path):
    rows = [{"video": "long.mp4", "caption": "a car"}, {"video": "long.mp4", "caption": "x", "condition_frames": 1}]
    path = write_jsonl(tmp_path / "one.jsonl", rows)
    assert main(["build", "--source", "video_gen", "--input", path, "--image-root", str(clips["folder"] / "clips"),
                 "--tokenizer", tokenizer_dir(), "--output", str(tmp_path / "one"), "--min-frames", "1",
                 "--max-frames", "1", "--max-skip-rate", "1", "--quiet"]) == 0
    dataset = MMIDXDataset(tmp_path / "one")
    report = json.loads((tmp_path / "one.report.json").read_text())
    assert len(dataset) == 1 and report["skips"]["no_target_frames"]["count"] == 1
    t2i = [dict(TEXT), {"type": "vae_image", "enable_cfg": 0, "loss": 1, "special_token_loss": 0,
                        "special_token_label": None, "split_start": True, "split_end": True}]
    assert all(bagel_keys(dataset[0].sequence_plan(view)) == t2i for view in range(4))


def test_a_group_decay_outside_zero_to_one_is_one_line(clips, tmp_path, capsys):
    path = write_jsonl(tmp_path / "x.jsonl", GOOD_ROWS[:1])
    assert main(["build", "--source", "video_gen", "--input", path, "--tokenizer", tokenizer_dir(),
                 "--output", str(tmp_path / "x"), "--group-decay", "1.5", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "group_decay" in err and "[0, 1]" in err


# --------------------------------------------------------------------------- grouping draws

COMPOSITIONS = [tuple(b - a for a, b in itertools.pairwise((0, *cuts, 5)))
                for n in range(5) for cuts in itertools.combinations(range(1, 5), n)]


def _chi_square_p(counts, probabilities, draws):
    observed = np.array([counts[c] for c in COMPOSITIONS], dtype=np.float64)
    expected = np.array([probabilities[c] for c in COMPOSITIONS]) * draws
    statistic = float(((observed - expected) ** 2 / expected).sum())
    df = len(COMPOSITIONS) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


@pytest.mark.parametrize("decay", [1.0, 0.5])
def test_group_draws_follow_split_integer_exp_decays_definition(decay):
    draws = 20_000
    rng = random.Random(2024)  # fixed: the test cannot flake
    counts = collections.Counter(tuple(split_integer_exp_decay(rng, 5, decay)[0]) for _ in range(draws))
    assert set(counts) <= set(COMPOSITIONS) and math.isclose(sum(map(composition_probability, COMPOSITIONS,
                                                                      [decay] * 16)), 1.0)
    definition = {c: composition_probability(c, decay) for c in COMPOSITIONS}
    assert _chi_square_p(counts, definition, draws) > 1e-3
    if decay != 1.0:  # the test has power: compositions taken as equally likely are rejected
        assert _chi_square_p(counts, dict.fromkeys(COMPOSITIONS, 1 / 16), draws) < 1e-6


@pytest.mark.parametrize("decay", [1.0, 0.5, 0.0])
def test_group_draws_are_bagels_own_on_the_same_generator_state(decay):
    state = random.getstate()
    try:
        random.seed(11)
        bagel = [bagel_split(total, decay) for total in range(1, 13) for _ in range(50)]
    finally:
        random.setstate(state)
    rng = random.Random(11)
    assert [split_integer_exp_decay(rng, total, decay) for total in range(1, 13) for _ in range(50)] == bagel
    if decay == 0.0:
        assert all(len(sizes) == 1 for sizes, _ in bagel)


# --------------------------------------------------------------------------- packed batches


def _config(prefix, dropout):
    return DataConfig.from_dict({"groups": {"video": {"datasets": [str(prefix)], "image_transform_args": VAE}},
                                 "dropout": dropout, "geometry": GEOMETRY, "seed": 3,
                                 "packing": {"max_num_tokens": 1024, "expected_num_tokens": 512,
                                             "max_num_tokens_per_sample": 512}})


PACKS = [[PackItem(0, 0, s, v) for s in range(4)] for v in range(VIEWS)]
NO_DROPOUT = {"text": 0.0, "vit": 0.0, "vae": 0.0}


def _spans(sample, view, latent_tokens):
    """(first token, tokens) of each element of a view, nothing dropped: text n + 2, VAE latents + 2."""
    spans, at = [], 0
    vae = iter(latent_tokens)
    for item in sample.sequence_plan(view):
        length = len(sample.texts[item["payload"]]) + 2 if item["type"] == "text" else next(vae) + 2
        spans.append((at, length))
        at += length
    return spans


def _block_mask_allows(block_mask, length):
    size = block_mask.BLOCK_SIZE[0]
    blocks = -(-length // size)
    partial, full = torch.zeros(blocks, blocks, dtype=torch.bool), torch.zeros(blocks, blocks, dtype=torch.bool)
    for row in range(blocks):
        partial[row, block_mask.kv_indices[0, 0, row, :block_mask.kv_num_blocks[0, 0, row]].long()] = True
        full[row, block_mask.full_kv_indices[0, 0, row, :block_mask.full_kv_num_blocks[0, 0, row]].long()] = True
    q = torch.arange(length)
    blocks_of = (q // size)
    predicate = block_mask.mask_mod(None, None, q[:, None], q[None, :])
    return full[blocks_of][:, blocks_of] | (partial[blocks_of][:, blocks_of] & predicate)


@pytest.mark.parametrize("use_flex", [False, True])
def test_packs_share_a_timestep_per_group_advance_rope_by_frame_delta_and_mask_as_diffusion_forcing(clips, use_flex):
    dataset, _ = clips["grouped"]
    builder = PackBuilder(_config(dataset.prefix, NO_DROPOUT), use_flex=use_flex)
    for pack_index, items in enumerate(PACKS):
        batch = builder.build(pack_index, items)
        data = batch.to_dict()
        timesteps, positions = data["packed_timesteps"], data["packed_position_ids"]
        allows = _block_mask_allows(batch.attention_masks(), batch.max_num_tokens) if use_flex else None
        shapes = iter(h * w for h, w in data["patchified_vae_latent_shapes"])
        vae_tokens = iter(data["packed_vae_token_indexes"].tolist())
        first = 0
        for position, item in enumerate(items):
            sample = dataset[item.sample]
            plan, condition = sample.sequence_plan(item.view), GOOD_ROWS[item.sample].get("condition_frames", 0)
            spans = _spans(sample, item.view, [next(shapes) for e in plan if e["type"] == "vae_image"])
            mask = (allows[first:first + sum(n for _, n in spans), first:first + sum(n for _, n in spans)]
                    if use_flex else ~torch.isinf(data["nested_attention_masks"][position]))
            # timesteps: one per group, -inf for conditioning frames
            values, group = [], -1
            for e, (start, length) in zip(plan[1:], spans[1:], strict=True):
                tokens = [next(vae_tokens) for _ in range(length - 2)]
                assert tokens == list(range(first + start + 1, first + start + length - 1))
                frame = timesteps[_vae_rows(data, tokens)]
                assert (frame == frame[0]).all()
                if not e["loss"]:
                    assert torch.isinf(frame[0]) and frame[0] < 0
                    continue
                group += e["split_start"]
                if e["split_start"]:
                    values.append(float(frame[0]))
                assert float(frame[0]) == values[group] and math.isfinite(values[group])
            assert len(set(values)) == len(values) == len(target_groups(plan, condition))
            # rope ids: text 0..n+1, then each frame's tokens share one id, advanced by frame_delta (+1 after a
            # clean frame without one, +0 after a noised one)
            text_len = spans[0][1]
            assert positions[first:first + text_len].tolist() == list(range(text_len))
            rope = text_len
            for e, (start, length) in zip(plan[1:], spans[1:], strict=True):
                assert (positions[first + start:first + start + length] == rope).all()
                rope += e["frame_delta"] if "frame_delta" in e else int(not e["loss"])
            # masks: each split sees itself fully and everything before it; nothing before a noised group sees it
            split_bounds = [spans[0], *_split_spans(plan, spans)]
            for start, length in split_bounds[1:]:
                assert mask[start:start + length, :start + length].all()
                assert not mask[:start, start:start + length].any()
            caption = spans[0][1]
            assert torch.equal(mask[:caption, :caption], torch.ones(caption, caption, dtype=torch.bool).tril())
            first += sum(n for _, n in spans)
        assert first == data["sequence_length"]


def _vae_rows(data, tokens):
    """Rows of packed_timesteps (one per VAE token, in packed_vae_token_indexes' order) of ``tokens``."""
    index = {t: i for i, t in enumerate(data["packed_vae_token_indexes"].tolist())}
    return [index[t] for t in tokens]


def _split_spans(plan, spans):
    """(first token, tokens) of each VAE split, from the split flags."""
    out = []
    for item, (start, length) in zip(plan[1:], spans[1:], strict=True):
        if item["split_start"]:
            out.append([start, 0])
        out[-1][1] = start + length - out[-1][0]
    return [tuple(span) for span in out]


@pytest.mark.parametrize("use_flex", [False, True])
@pytest.mark.parametrize("dropout", [NO_DROPOUT, {"text": 0.5, "vit": 0.0, "vae": 0.0}])
def test_packs_equal_the_naive_reference_of_the_spec_key_by_key(clips, use_flex, dropout):
    for name in ("grouped", "plain"):
        dataset, _ = clips[name]
        config = _config(dataset.prefix, dropout)
        builder = PackBuilder(config, use_flex=use_flex)
        for pack_index, items in enumerate(PACKS):
            samples = []
            for position, item in enumerate(items):
                sample = dataset[item.sample]
                plan = sample.sequence_plan(item.view)
                uniforms, normals = sample_randomness(config.seed, pack_index, position, len(plan))
                samples.append({"plan": plan, "texts": sample.texts, "images": [i.data for i in sample.images],
                                "uniforms": uniforms.tolist(), "normals": normals.tolist(), "vae_args": VAE,
                                "vit_args": VAE})
            expected = reference_pack(samples, builder.special_tokens, dropout, GEOMETRY,
                                      config.packing.max_num_tokens, use_flex)
            ours = builder.build(pack_index, items).to_dict()
            for key, value in expected.items():
                if key == "nested_attention_masks":
                    assert all(torch.equal(a, b) for a, b in zip(ours[key], value, strict=True))
                elif isinstance(value, torch.Tensor):
                    assert ours[key].dtype == value.dtype and torch.equal(ours[key], value), key
                else:
                    assert ours[key] == value, key


def test_show_draws_each_group_as_its_own_labelled_split_with_its_noise_level(clips):
    dataset, _ = clips["grouped"]
    found = next((s, v) for s in (1, 2) for v in range(VIEWS)
                 if len(target_groups(dataset[s].sequence_plan(v), GOOD_ROWS[s]["condition_frames"])) >= 2)
    items = [PackItem(0, 0, 0, 0), PackItem(0, 0, *found)]
    batch = PackBuilder(_config(dataset.prefix, NO_DROPOUT)).build(0, items)
    kinds, _ = kinds_of(batch, batch.max_num_tokens)
    labels = split_labels(batch, 1, kinds)
    groups = len(target_groups(dataset[found[0]].sequence_plan(found[1]), GOOD_ROWS[found[0]]["condition_frames"]))
    assert labels[0].startswith("causal text") and labels[1].startswith("full vae_clean")
    noised = labels[2:]
    assert len(noised) == groups and len({label.split()[2] for label in noised}) == groups  # distinct t=...
    width = 800
    pixels = np.asarray(render(batch, width=width, zoom_sample=1))
    size = width - LEFT - 10
    zoom_top = (2 * LINE + 10 + TOP_LABELS + STRIP + LOSS_BAR + 2 + size + 8 + LINE * 3 + 8 + 3 * LINE)
    edges = split_scaled_edges(batch.split_lens[1], size, 24)
    strip_row, panel_top = zoom_top + TOP_LABELS + STRIP // 2, zoom_top + TOP_LABELS + STRIP + LOSS_BAR + 2
    for edge in edges[1:-1]:  # a boundary between every two splits, groups included
        assert tuple(pixels[strip_row, LEFT + edge]) == BOUNDARY_COLOUR
    middle = [(a + b) // 2 for a, b in itertools.pairwise(edges)]
    noised_colour = COLOURS["vae_noised"]
    # the second group's rows see the first group (noised colour); the first group's rows do not see the second
    assert tuple(pixels[panel_top + middle[3], LEFT + middle[2]]) == noised_colour
    assert tuple(pixels[panel_top + middle[2], LEFT + middle[3]]) == (255, 255, 255)


def test_middle_sampling_gives_interval_middles_and_their_spacing_as_frame_delta(clips, tmp_path):
    path = write_jsonl(tmp_path / "middle.jsonl", GOOD_ROWS[:1])
    dataset, _ = build("video_gen", [path], tmp_path / "middle", image_root=str(clips["folder"] / "clips"),
                       views=2, min_frames=5, max_frames=5, frame_sample="middle", grouping=False)
    middles = [(a + b - 1) // 2 for a, b in itertools.pairwise(range(0, 31, 6))]  # 30 frames, 5 intervals of 6
    for view in range(2):
        assert frame_numbers(dataset[0], view) == middles == [2, 8, 14, 20, 26]
        assert bagel_keys(dataset[0].sequence_plan(view)) == [dict(TEXT), *add_video(middles, True, False)]
