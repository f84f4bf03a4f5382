"""edit: every view is BAGEL's parse_row draw, images are stored once and byte-identical, texts deduplicated."""

import pyarrow as pa
import pytest
from support.sources import build, encode, image_bytes, texts_of, write_parquet

from mmidx.sources import SourceContext, SourceOptions

IMAGE_COUNTS = [2, 3, 4, 5, 5, 6]
VIEWS = 8
SEED = 7


def _instructions(row, count):
    return [[f"step {k} of row {row} option {o}" for o in range(1 + (row + k) % 3)] for k in range(count - 1)]


@pytest.fixture(scope="module")
def edit(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edit")
    images = [[image_bytes(32 + k, 24, seed=100 * row + k) for k in range(n)] for row, n in enumerate(IMAGE_COUNTS)]
    instructions = [_instructions(row, n) for row, n in enumerate(IMAGE_COUNTS)]
    path = write_parquet(folder / "edit.parquet", {"image_list": images, "instruction_list": instructions},
                         {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))},
                         row_group_size=4)
    dataset, _report = build("edit", [path], folder / "out", views=VIEWS, seed=SEED)
    return dataset, images, instructions, path


def bagel_parse_row(rng, image_num, instruction_list):
    """BAGEL's UnifiedEditIterableDataset.parse_row, transcribed, with ``rng`` in place of ``random``.

    Returns the plan as (kind, image number or instruction text, loss, enable_cfg) tuples.
    """
    start_idx = rng.choice(range(image_num - 1))
    max_end = min(start_idx + 3, image_num)
    end_idx = rng.choice(range(start_idx + 1, max_end))
    plan = [("vae_image", start_idx, 0, 1), ("vit_image", start_idx, 0, 1)]
    if end_idx - start_idx > 1 and rng.random() < 0.5:
        if end_idx == image_num - 1:
            end_idx -= 1
        instruction = ""
        for idx in range(start_idx + 1, end_idx + 1):
            instruction += rng.choice(instruction_list[idx - 1]) + ". "
        plan += [("text", instruction.rstrip(), 0, 1), ("vae_image", end_idx, 1, 0)]
    else:
        for idx in range(start_idx + 1, end_idx + 1):
            plan.append(("text", rng.choice(instruction_list[idx - 1]), 0, 1))
            plan.append(("vae_image", idx, 1, 0))
            if idx != end_idx:
                plan += [("vae_image", idx, 0, 1), ("vit_image", idx, 0, 1)]
    return plan


def _stored_view(sample, view, row_images):
    """A stored view in bagel_parse_row's terms: texts as token lists, images as row positions."""
    position = {data: k for k, data in enumerate(row_images)}
    plan = []
    for element in sample.sequence_plan(view):
        if element["type"] == "text":
            what = sample.text(element["payload"]).tolist()
        else:
            what = position[bytes(sample.image(element["payload"]).data)]
        plan.append((element["type"], what, element["loss"], element["enable_cfg"]))
    return plan


def test_every_view_is_bagels_draw_from_the_rows_seeded_generator(edit):
    dataset, images, instructions, path = edit
    context = SourceContext(None, SourceOptions(seed=SEED))
    for row in range(len(IMAGE_COUNTS)):
        rng = context.rng(path, row)
        for view in range(VIEWS):
            expected = [(kind, encode(what) if kind == "text" else what, loss, cfg)
                        for kind, what, loss, cfg in bagel_parse_row(rng, IMAGE_COUNTS[row], instructions[row])]
            assert _stored_view(dataset[row], view, images[row]) == expected, (row, view)


def test_the_draws_exercise_concat_mode_sequential_chains_and_the_end_decrement(edit):
    _, _, instructions, path = edit
    context = SourceContext(None, SourceOptions(seed=SEED))
    plans = []
    for row, count in enumerate(IMAGE_COUNTS):
        rng = context.rng(path, row)
        plans += [(count, bagel_parse_row(rng, count, instructions[row])) for _ in range(VIEWS)]
    texts = [[what for kind, what, _, _ in plan if kind == "text"] for _, plan in plans]
    assert any(len(t) == 1 and ". step" in t[0] for t in texts)  # concat of two steps
    assert any(len(t) == 1 and t[0].endswith(".") for t in texts)  # concat cut to one step by end -= 1
    assert any(len(t) == 2 for t in texts)  # sequential, two steps


def test_every_stored_image_is_byte_identical_to_a_row_image_stored_once_in_row_order(edit):
    dataset, images, _, _ = edit
    for row in range(len(dataset)):
        sample = dataset[row]
        stored = [bytes(image.data) for image in sample.images]
        positions = [images[row].index(data) for data in stored]
        assert positions == sorted(set(positions))
        used = {element["payload"] for v in range(VIEWS) for element in sample.sequence_plan(v)
                if element["type"] != "text"}
        assert used == set(range(len(stored)))


def test_an_intermediate_image_is_one_stored_image_for_its_noised_clean_and_vit_elements(edit):
    dataset = edit[0]
    shared = 0
    for row in range(len(dataset)):
        for view in range(VIEWS):
            uses = {}
            for element in dataset[row].sequence_plan(view):
                if element["type"] != "text":
                    uses.setdefault(element["payload"], []).append((element["type"], element["loss"]))
            shared += sum(sorted(u) == [("vae_image", 0), ("vae_image", 1), ("vit_image", 0)] for u in uses.values())
    assert shared > 0


def test_texts_are_deduplicated_across_views_and_all_used(edit):
    dataset = edit[0]
    for row in range(len(dataset)):
        sample = dataset[row]
        texts = [tuple(t) for t in texts_of(sample)]
        assert len(texts) == len(set(texts))
        used = {e["payload"] for v in range(VIEWS) for e in sample.sequence_plan(v) if e["type"] == "text"}
        assert used == set(range(len(texts)))
