"""vlm: elements exactly as BAGEL's change_format makes them, img_num, and video frames drawn and decoded as BAGEL."""

import itertools

import numpy as np
import pytest
from support.cases import CASES, FILES
from support.sources import build, decoded, encode, pyav_frames, write_jsonl, write_mp4

MIN_FRAMES, MAX_FRAMES, VIEWS = 8, 12, 4


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    path = write_jsonl(folder / "sft.jsonl", [row for row, _ in CASES])
    dataset, report = build("vlm", [path], folder / "out", views=VIEWS, image_root=str(folder))
    return dataset, report


def _elements(sample, view=0):
    out = []
    for element in sample.sequence_plan(view):
        assert element["enable_cfg"] == 0
        if element["type"] == "text":
            out.append(("text", sample.text(element["payload"]).tolist(), element["loss"]))
        else:
            assert (element["type"], element["loss"]) == ("vit_image", 0)
            out.append(("image", bytes(sample.image(element["payload"]).data)))
    return out


@pytest.mark.parametrize("case", range(len(CASES)))
def test_elements_are_exactly_change_formats(images, case):
    row, expected = CASES[case]
    names = row.get("image", [])
    names = names if isinstance(names, list) else [names]
    want = [("text", encode(e[1]), e[2]) if e[0] == "text" else ("image", FILES[names[e[1]]]) for e in expected]
    sample = images[0][case]
    assert _elements(sample) == want
    assert sample.num_views == 1


def test_img_num_is_the_number_of_images_the_row_lists(images):
    dataset = images[0]
    for case, (row, _) in enumerate(CASES):
        count = len(row["image"]) if isinstance(row.get("image"), list) else 1
        assert {e["img_num"] for e in dataset[case].sequence_plan(0) if e["type"] == "vit_image"} <= {count}


def test_only_images_that_have_a_placeholder_are_stored(images):
    sample = images[0][4]  # three images listed, one <image>
    assert [bytes(image.data) for image in sample.images] == [FILES["c.jpg"]]


# --------------------------------------------------------------------------- video

VIDEOS = {"long.mp4": 30, "medium.mp4": 14, "short.mp4": 6}


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("video")
    for name, frames in VIDEOS.items():
        write_mp4(folder / name, frames)
    rows = [{"video": name, "conversations": [{"from": "human", "value": "<video>\nWhat happens?"},
                                              {"from": "gpt", "value": "Colours change."}]} for name in VIDEOS]
    rows.append({"video": "long.mp4", "conversations": [{"from": "human", "value": "Watch."},
                                                        {"from": "gpt", "value": "Ok."},
                                                        {"from": "human", "value": "Now <video> what?"},
                                                        {"from": "gpt", "value": "Colours."}]})
    path = write_jsonl(folder / "video.jsonl", rows)
    dataset, report = build("vlm", [path], folder / "out", views=VIEWS, image_root=str(folder),
                            min_frames=MIN_FRAMES, max_frames=MAX_FRAMES)
    frames = {name: pyav_frames(folder / name) for name in VIDEOS}
    return dataset, report, frames


def _frame_numbers(sample, view):
    numbers = sample.extra["video_frames"]
    return [numbers[e["payload"]] for e in sample.sequence_plan(view) if e["type"] == "vit_image"]


def _is_bagel_rand_draw(frames, count, vlen):
    """get_frame_indices(count, vlen, 'rand'): one frame in [a, b - 2] of each interval, else the fallback."""
    acc = min(count, vlen)
    intervals = np.linspace(0, vlen, acc + 1).astype(int)
    head, tail = frames[:acc], frames[acc:]
    if tail != [head[-1]] * (count - acc):
        return False
    if all(b - 1 > a for a, b in itertools.pairwise(intervals)):
        return all(a <= f <= b - 2 for f, a, b in zip(head, intervals[:-1], intervals[1:], strict=False))
    return head == sorted(set(head)) and all(0 <= f < vlen for f in head)


def test_each_view_draws_between_min_and_max_frames_as_bagels_rand_sampler(videos):
    dataset, _, _ = videos
    for row, (name, vlen) in enumerate(VIDEOS.items()):
        for view in range(VIEWS):
            numbers = _frame_numbers(dataset[row], view)
            assert MIN_FRAMES <= len(numbers) <= MAX_FRAMES
            assert _is_bagel_rand_draw(numbers, len(numbers), vlen), (name, numbers)


def test_video_becomes_n_images_with_img_num_n_before_the_question(videos):
    dataset = videos[0]
    for view in range(VIEWS):
        plan = dataset[0].sequence_plan(view)
        count = len(_frame_numbers(dataset[0], view))
        assert [e["type"] for e in plan] == ["vit_image"] * count + ["text", "text"]
        assert {e["img_num"] for e in plan[:count]} == {count}
        assert dataset[0].text(plan[count]["payload"]).tolist() == encode("What happens?")


def test_the_views_are_different_draws_of_the_long_video(videos):
    dataset = videos[0]
    assert len({tuple(_frame_numbers(dataset[0], view)) for view in range(VIEWS)}) > 1


def test_each_frame_is_stored_once_and_decodes_to_pyavs_frame_at_its_number(videos):
    dataset, _, frames = videos
    for row, name in enumerate(VIDEOS):
        sample = dataset[row]
        numbers = sample.extra["video_frames"]
        assert numbers == sorted(set(numbers)) and sample.num_images == len(numbers)
        reference = np.stack(frames[name]).astype(np.int16)
        for j, number in enumerate(numbers):
            pixels = decoded(sample.image(j).data).astype(np.int16)
            distances = np.abs(reference - pixels).mean(axis=(1, 2, 3))
            assert distances[number] < 4 and int(np.argmin(distances)) == number


def test_video_placeholder_in_a_later_turn_is_expanded_there(videos):
    dataset = videos[0]
    plan = dataset[3].sequence_plan(0)
    count = len(_frame_numbers(dataset[3], 0))
    assert [e["type"] for e in plan] == ["text", "text", "text"] + ["vit_image"] * count + ["text", "text"]
    assert dataset[3].text(plan[2]["payload"]).tolist() == encode("Now")


def test_image_names_default_to_the_jsonl_files_folder(images, tmp_path):
    dataset, _ = images
    path = dataset.metadata["build"]["inputs"][0]
    again, _ = build("vlm", [path], tmp_path / "again")
    assert [bytes(again[i].image(0).data) for i in (0, 1)] == [bytes(dataset[i].image(0).data) for i in (0, 1)]
