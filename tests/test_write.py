"""mmidx.write: a user's function over a folder of images and a CSV of captions, built with mmidx build's
guarantees — byte-identical at any worker count and engine, resumable after kill -9, skips counted, verify OK."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from support.build_cases import kill_at_first_shard
from support.sources import image_bytes, tokenizer_dir

import mmidx
from mmidx import Element
from mmidx.format import file_path
from mmidx.ingest.plan import BuildError
from mmidx.read.checks import verify

DATA_FILES = ("bin", "idx", "images", "plan", "meta")

# The user's program, as a user writes it: a function of one CSV row, mmidx.write over the rows.
USER_SCRIPT = '''
import csv, sys, time
import mmidx
from mmidx import Element

folder, tokenizer, output, workers, delay = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])

def t2i_sample(row):
    time.sleep(delay)
    if not row["caption"].strip():
        raise ValueError("empty caption")
    return {"texts": [row["caption"]], "images": [row["image"]],
            "views": [Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)],
            "extra": {"image": row["image"].rsplit("/", 1)[-1]}}

with open(folder + "/captions.csv", newline="") as f:
    rows = list(csv.DictReader(f))
report = mmidx.write(t2i_sample, rows, output, tokenizer=tokenizer, workers=workers, inputs_per_unit=2,
                     max_skip_rate=0.5, progress=False)
print(report.summary())
sys.exit(0 if report.ok else 1)
'''


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """12 images and a captions.csv of 15 rows: one names a missing file, one a corrupt image, one has no caption."""
    folder = tmp_path_factory.mktemp("photos")
    rows = []
    for i in range(12):
        (folder / f"{i:02d}.png").write_bytes(image_bytes(48 + 8 * i, 40, "RGB", "PNG", seed=i))
        rows.append({"image": str(folder / f"{i:02d}.png"), "caption": f"photo number {i} of a cat"})
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff not a jpeg")
    rows[3:3] = [{"image": str(folder / "missing.png"), "caption": "gone"}]
    rows[7:7] = [{"image": str(folder / "broken.jpg"), "caption": "broken"}]
    rows[10:10] = [{"image": str(folder / "05.png"), "caption": "  "}]
    with open(folder / "captions.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["image", "caption"])
        writer.writeheader()
        writer.writerows(rows)
    (folder / "user.py").write_text(USER_SCRIPT)
    return folder


def _run(photos, output, workers, delay=0.0):
    return [sys.executable, str(photos / "user.py"), str(photos), tokenizer_dir(), str(output), str(workers),
            str(delay)]


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


@pytest.fixture(scope="module")
def serial(photos, tmp_path_factory):
    output = tmp_path_factory.mktemp("serial") / "photos"
    subprocess.run(_run(photos, output, 1), env=_env(), check=True, capture_output=True)
    return output


def _same_files(a, b):
    return all(file_path(os.fspath(a), role).read_bytes() == file_path(os.fspath(b), role).read_bytes()
               for role in DATA_FILES)


def test_the_built_dataset_holds_each_good_row_in_csv_order_and_counts_each_bad_one(serial, photos):
    dataset = mmidx.MMIDXDataset(serial)
    assert len(dataset) == 12 and verify(serial) == []
    assert [dataset[i].extra["image"] for i in range(12)] == [f"{i:02d}.png" for i in range(12)]
    assert [row for _, row in (dataset[i].origin for i in range(12))] == [0, 1, 2, 4, 5, 6, 8, 9, 11, 12, 13, 14]
    first = dataset[0]
    assert bytes(first.images[0].data) == (photos / "00.png").read_bytes() and first.images[0].width == 48
    report = json.loads(Path(f"{serial}.report.json").read_text())
    assert report["rows"] == 15 and report["samples"] == 12 and report["units"] == 8
    skips = {reason: entry["count"] for reason, entry in report["skips"].items()}
    assert skips == {"missing_file": 1, "undecodable_image": 1, "function_error": 1}
    assert report["skips"]["function_error"]["examples"][0] == {"file": "t2i_sample", "row": 10,
                                                                "detail": "ValueError: empty caption"}


def test_kill_9_mid_build_with_2_workers_then_rerun_gives_the_files_of_a_1_worker_build(serial, photos, tmp_path):
    output = tmp_path / "photos"
    finished = kill_at_first_shard(_run(photos, output, 2, delay=0.25), output)
    shards = Path(f"{output}.shards")
    assert 1 <= finished < 8 and not file_path(os.fspath(output), "idx").exists()
    rerun = subprocess.run(_run(photos, output, 2), env=_env(), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"8 units, {finished} reused" in rerun.stdout
    assert _same_files(output, serial) and verify(output) == []
    assert not shards.exists()


def _caption_sample(path):
    return {"texts": [f"a picture called {Path(path).stem}"], "images": [path],
            "views": [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]]}


def test_the_ray_engine_writes_the_files_of_the_local_one(serial, photos, tmp_path, cluster):
    paths = sorted(str(p) for p in photos.glob("??.png"))
    local = mmidx.write(_caption_sample, paths, tmp_path / "local" / "out", tokenizer=tokenizer_dir(),
                        inputs_per_unit=3, progress=False)
    ray = mmidx.write(_caption_sample, paths, tmp_path / "ray" / "out", tokenizer=tokenizer_dir(), inputs_per_unit=3,
                      engine="ray", ray_address=cluster, progress=False)
    assert local.ok and ray.ok and ray.data["units"] == 4
    # the metadata too: both outputs have the same base name, as the metadata records it
    assert _same_files(tmp_path / "ray" / "out", tmp_path / "local" / "out") and verify(tmp_path / "ray" / "out") == []


def test_a_rerun_over_other_inputs_refuses_in_one_line_and_force_replaces(photos, tmp_path):
    paths = sorted(str(p) for p in photos.glob("??.png"))
    write = lambda items, **kw: mmidx.write(_caption_sample, items, tmp_path / "out",  # noqa: E731 (a closure)
                                            tokenizer=tokenizer_dir(), progress=False, **kw)
    assert write(paths).ok
    assert write(paths).message.startswith("already built")
    with pytest.raises(BuildError, match="built from other inputs or options") as error:
        write(paths[:5])
    assert "\n" not in str(error.value)
    assert write(paths[:5], force=True).ok and len(mmidx.MMIDXDataset(tmp_path / "out")) == 5


def test_an_edited_input_file_is_built_again_on_resume(photos, tmp_path):
    image = tmp_path / "one.png"
    image.write_bytes(image_bytes(48, 40, "RGB", "PNG", seed=1))
    mmidx.write(_caption_sample, [str(image)], tmp_path / "out", tokenizer=tokenizer_dir(), progress=False)
    image.write_bytes(image_bytes(64, 40, "RGB", "PNG", seed=2))
    with pytest.raises(BuildError, match="other inputs"):
        mmidx.write(_caption_sample, [str(image)], tmp_path / "out", tokenizer=tokenizer_dir(), progress=False)


@pytest.mark.parametrize("made, reason", [
    ({"texts": ["a"], "images": [], "views": [Element("vae_image", 0)]}, "payload 0"),
    ({"texts": ["a"], "views": []}, "views must be"),
    ({"texts": ["a"], "views": [Element("text", 0)], "colour": 1}, "unknown keys"),
    ("just a string", "not a sample"),
    ({"texts": ["a"], "views": [Element("text", 0, loss=True)], "extra": {"x": object()}}, "JSON"),
    ({"texts": [[1, 2, 10**9]], "views": [Element("text", 0, loss=True)]}, "outside the tokenizer's vocabulary"),
    ({"texts": [["one"]], "views": [Element("text", 0, loss=True)]}, "not a list of token ids"),
    ({"texts": [b"bytes"], "views": [Element("text", 0, loss=True)]}, "give a string or token ids"),
    ({"texts": ["a"], "views": [Element("text", 0, img_num=0)]}, "img_num"),
    ({"texts": ["a"], "images": [3.5], "views": [Element("text", 0)]}, "give bytes, a file path or a PIL image"),
])
def test_a_sample_that_is_not_one_is_a_counted_skip_naming_what_is_wrong(made, reason, tmp_path):
    def fn(i):
        if i == 0:
            return made
        return {"texts": [f"text {i}"], "images": [Image.new("RGB", (32, 24), (i, 0, 0))],
                "views": [Element("vit_image", 0), Element("text", 0, loss=True)]}

    report = mmidx.write(fn, range(4), tmp_path / "out", tokenizer=tokenizer_dir(), max_skip_rate=0.5,
                         progress=False)
    assert report.ok and report.data["samples"] == 3 and report.data["skipped"] == 1
    stored = mmidx.MMIDXDataset(tmp_path / "out")[0].images[0]
    assert (stored.format, stored.width, stored.height) == ("PNG", 32, 24)  # a PIL image is stored as PNG
    assert reason in report.data["skips"]["malformed_record"]["examples"][0]["detail"]


def test_a_generator_that_fails_half_way_stores_none_of_its_samples(tmp_path):
    def fn(i):
        yield {"texts": [f"first of {i}"], "views": [Element("text", 0, loss=True)]}
        if i == 1:
            raise KeyError("boom")
        yield {"texts": [[5, 6, 7]], "views": [Element("text", 0, loss=True)]}

    report = mmidx.write(fn, [0, 1, 2], tmp_path / "out", tokenizer=tokenizer_dir(), max_skip_rate=0.5,
                         progress=False)
    dataset = mmidx.MMIDXDataset(tmp_path / "out")
    assert report.data["samples"] == len(dataset) == 4
    assert [dataset[i].origin[1] for i in range(4)] == [0, 0, 2, 2]
    assert report.data["skips"]["function_error"]["examples"][0]["detail"] == "KeyError: 'boom'"


def test_bad_arguments_are_refused_before_anything_runs(tmp_path):
    with pytest.raises(TypeError, match="wrap a single input"):
        mmidx.write(_caption_sample, "one.png", tmp_path / "out", tokenizer=tokenizer_dir())
    with pytest.raises(ValueError, match="at least one input"):
        mmidx.write(_caption_sample, [], tmp_path / "out", tokenizer=tokenizer_dir())
    with pytest.raises(ValueError, match="unknown engine"):
        mmidx.write(_caption_sample, ["x"], tmp_path / "out", tokenizer=tokenizer_dir(), engine="spark")
