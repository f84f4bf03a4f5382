"""Video frames: stored losslessly, sampled with every mode of BAGEL's FrameSampler, frame folders too."""

import io
import itertools
import json
import os
import random

import av
import numpy as np
import pytest
from PIL import Image
from support.sources import build, decoded, image_bytes, pyav_frames, write_jsonl

from mmidx.format import FormatError
from mmidx.sources import SourceContext, SourceOptions, media
from mmidx.sources.media import frame_indices, frame_sampler_options

VIEWS = 3
CONVERSATION = [{"from": "human", "value": "<video>\nWhat happens?"}, {"from": "gpt", "value": "Things move."}]


def bagel_frame_indices(rng, min_frames, max_frames, vlen, sample, fix_start=None, input_fps=1.0, folder=False):
    """BAGEL's rules (video_utils.py), restated: n = randint(min, max); a folder of at most n frames
    gives them all; get_frame_indices(n, vlen, sample, fix_start, input_fps) otherwise. ``rng``
    stands in for both of BAGEL's generators."""
    num_frames = rng.randint(min_frames, max_frames)
    if folder and vlen <= num_frames:
        return list(range(vlen))
    if sample in ("rand", "middle"):
        acc_samples = min(num_frames, vlen)
        bounds = np.linspace(start=0, stop=vlen, num=acc_samples + 1).astype(int)
        ranges = [(int(bounds[i]), int(bounds[i + 1]) - 1) for i in range(acc_samples)]
        if sample == "rand":
            try:
                indices = [rng.choice(range(start, end)) for start, end in ranges]
            except IndexError:
                indices = sorted(rng.sample(range(vlen), acc_samples))
        elif fix_start is not None:
            indices = [start + fix_start for start, _ in ranges]
        else:
            indices = [(start + end) // 2 for start, end in ranges]
        return indices + [indices[-1]] * (num_frames - len(indices))
    output_fps = float(sample[3:])
    delta = 1 / output_fps
    seconds = np.arange(0 + delta / 2, float(vlen) / input_fps + delta / 2, delta)
    return [int(i) for i in np.around(seconds * input_fps).astype(int) if i < vlen]


MODES = [("rand", None), ("middle", None), ("middle", 0), ("middle", 1), ("fps0.5", None), ("fps2", None),
         ("fps1.3", None)]


@pytest.mark.parametrize(("sample", "fix_start"), MODES)
def test_every_mode_gives_bagels_frame_indices_for_the_same_draws(sample, fix_start):
    options = SourceOptions(min_frames=3, max_frames=9, frame_sample=sample, frame_fix_start=fix_start)
    for vlen, fps, folder, seed in itertools.product((1, 2, 3, 5, 8, 9, 13, 40, 301), (1.0, 10.0, 29.97),
                                                     (False, True), range(4)):
        ours = frame_indices(random.Random(seed), vlen, options, fps=fps, folder=folder)
        expected = bagel_frame_indices(random.Random(seed), 3, 9, vlen, sample, fix_start, fps, folder)
        assert ours == expected, (vlen, fps, folder, seed)


def test_frame_sampler_args_set_the_mode_and_unknown_keys_are_refused_listing_the_known_ones():
    options = frame_sampler_options(SourceOptions(), {"min_num_frames": 2, "max_num_frames": 4, "sample": "middle",
                                                      "fix_start": 1})
    chosen = (options.min_frames, options.max_frames, options.frame_sample, options.frame_fix_start)
    assert chosen == (2, 4, "middle", 1)
    with pytest.raises(ValueError, match=r"unknown keys \['smaple'\]; the known ones are min_num_frames, "
                                         r"max_num_frames, sample, fix_start"):
        frame_sampler_options(SourceOptions(), {"smaple": "middle"})


@pytest.mark.parametrize("bad", [{"frame_sample": "uniform"}, {"frame_sample": "fps0"}, {"frame_sample": "5"},
                                 {"frame_sample": "rand", "frame_fix_start": 1}, {"frame_quality": 0}])
def test_meaningless_frame_options_are_refused(bad):
    with pytest.raises(ValueError):
        SourceOptions(**bad)


# --------------------------------------------------------------------------- builds


def write_noise_mp4(path, frames=20, width=64, height=48):
    """An H.264 clip of noise frames: any lossy re-encoding of its frames changes many pixels."""
    rng = np.random.default_rng(0)
    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for _ in range(frames):
            array = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip")
    write_noise_mp4(folder / "noise.mp4")
    return folder, write_jsonl(folder / "video.jsonl", [{"video": "noise.mp4", "conversations": CONVERSATION}])


def stored_frames(sample):
    return dict(zip(sample.extra["video_frames"], sample.images, strict=True))


def test_stored_frames_equal_pyavs_decode_of_the_source_exactly(clip, tmp_path):
    folder, jsonl = clip
    dataset, report = build("vlm", [jsonl], tmp_path / "out", views=VIEWS, min_frames=4, max_frames=6)
    assert report.ok
    source = pyav_frames(folder / "noise.mp4")
    frames = stored_frames(dataset[0])
    assert len(frames) >= 4
    for number, image in frames.items():
        assert Image.open(io.BytesIO(bytes(image.data))).format == "WEBP"
        assert np.array_equal(decoded(image.data), source[number])


def test_frames_wider_than_webp_allows_are_stored_as_png(clip, tmp_path, monkeypatch):
    folder, jsonl = clip
    monkeypatch.setattr(media, "_WEBP_MAX_SIDE", 63)  # the clip is 64 pixels wide
    dataset, _ = build("vlm", [jsonl], tmp_path / "out", views=1, min_frames=2, max_frames=2)
    source = pyav_frames(folder / "noise.mp4")
    for number, image in stored_frames(dataset[0]).items():
        assert Image.open(io.BytesIO(bytes(image.data))).format == "PNG"
        assert np.array_equal(decoded(image.data), source[number])


def test_a_frame_quality_stores_smaller_lossy_jpegs(clip, tmp_path):
    folder, jsonl = clip
    dataset, _ = build("vlm", [jsonl], tmp_path / "out", views=1, min_frames=4, max_frames=4, frame_quality=80)
    source = pyav_frames(folder / "noise.mp4")
    for number, image in stored_frames(dataset[0]).items():
        assert Image.open(io.BytesIO(bytes(image.data))).format == "JPEG"
        assert not np.array_equal(decoded(image.data), source[number])


@pytest.mark.parametrize(("sample", "fix_start"), [("middle", None), ("middle", 2), ("fps3", None)])
def test_a_build_stores_the_frames_bagels_sampler_picks(clip, tmp_path, sample, fix_start):
    _, jsonl = clip
    options = {"views": VIEWS, "min_frames": 3, "max_frames": 5, "frame_sample": sample, "frame_fix_start": fix_start}
    dataset, _ = build("vlm", [jsonl], tmp_path / "out", **options)
    rng = SourceContext(None, SourceOptions(**options)).rng(jsonl, 0)
    numbers = dataset[0].extra["video_frames"]
    for view in range(VIEWS):
        plan = dataset[0].sequence_plan(view)
        drawn = [numbers[e["payload"]] for e in plan if e["type"] == "vit_image"]
        assert drawn == bagel_frame_indices(rng, 3, 5, 20, sample, fix_start, input_fps=10.0)


def test_a_fix_start_past_the_last_frame_skips_the_row(clip, tmp_path):
    _, jsonl = clip
    with pytest.raises(FormatError, match="no dataset here"):  # its only row skipped: nothing is left that opens
        build("vlm", [jsonl], tmp_path / "out", min_frames=2, max_frames=2, frame_sample="middle",
              frame_fix_start=15)
    report = json.loads((tmp_path / "out.report.json").read_text())
    (skip,) = report["skips"]["undecodable_video"]["examples"]
    assert "sampling 'middle' gives frames [15, 25] of 20" in skip["detail"]


def test_a_frame_folder_is_sampled_in_bagels_frame_order_and_stored_as_is(tmp_path):
    frames = tmp_path / "clip"
    frames.mkdir()
    contents = {}
    for number in range(12):  # names whose text order differs from their number order
        contents[number] = image_bytes(32, 24, seed=number)
        (frames / f"frame_{number}.jpg").write_bytes(contents[number])
    rows = [{"video": "clip/", "conversations": CONVERSATION}]
    jsonl = write_jsonl(tmp_path / "video.jsonl", rows)
    options = {"views": VIEWS, "min_frames": 3, "max_frames": 14}
    dataset, report = build("vlm", [jsonl], tmp_path / "out", **options)
    assert report.ok
    rng = SourceContext(None, SourceOptions(**options)).rng(jsonl, 0)
    sample = dataset[0]
    stored = stored_frames(sample)
    assert all(bytes(stored[number].data) == contents[number] for number in stored)
    draws = [[sample.extra["video_frames"][e["payload"]] for e in sample.sequence_plan(view)
              if e["type"] == "vit_image"] for view in range(VIEWS)]
    assert draws == [bagel_frame_indices(rng, 3, 14, 12, "rand", folder=True) for _ in range(VIEWS)]
