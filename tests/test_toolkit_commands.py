"""mmidx bench, sample and show on the demo's data, and one clear line (never a traceback) on bad input."""

import argparse
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support.cases import CASES, FILES
from support.sources import build, image_bytes, write_jsonl

import mmidx
from mmidx.cli import main
from mmidx.pack.builder import PackBuilder
from mmidx.pack.masks import dense_masks, mask_predicate
from mmidx.toolkit.bench import STAGE_LABELS, STAGES, StageClock, bench_packs, format_report
from mmidx.toolkit.sample import describe_sample
from mmidx.toolkit.show import (
    COLOURS,
    LEFT,
    LINE,
    PALETTE,
    TOP_LABELS,
    mask_pixels,
    pixel_positions,
    render,
    split_scaled_edges,
)
from mmidx.toolkit.show import token_kinds as kinds_of


def test_stage_clock_counts_nested_stages_once():
    clock = StageClock()
    with clock("outer"):
        with clock("inner"):
            torch.ones(1)
    total = clock.seconds["outer"] + clock.seconds["inner"]
    assert clock.seconds["inner"] > 0 and clock.seconds["outer"] > 0 and total < 1.0


def test_bench_prints_rates_per_worker_count_stages_and_cores(demo):
    result = bench_packs(demo["config"], packs=3, workers=[0, 1], masks="flex", target_tokens_per_s=1e6)
    assert [row["workers"] for row in result["rows"]] == [0, 1]
    for row in result["rows"]:
        assert row["packs"] == 2 and row["tokens_per_s"] > 0 and row["bytes_per_pack"] > 1e6
    stages = result["stages"]
    assert set(stages["ms_per_pack"]) == set(STAGES) and abs(sum(stages["share"].values()) - 1) < 1e-9
    for stage in ("decode", "normalise", "assemble", "masks"):
        assert stages["ms_per_pack"][stage] > 0, stage
    assert result["cores_needed"] == int(np.ceil(1e6 / stages["tokens_per_s"]))
    text = format_report(result)
    for words in ("packs/s", "tokens/s", "samples/s", "MB/s", "resize+normalise/patchify", "cores needed",
                  "cores, Python"):
        assert words in text
    lines = text.splitlines()
    end = next(line for line in lines if line.startswith("stage ")).index("ms/pack") + len("ms/pack")
    for stage in STAGES:  # the stage table's columns line up under its header, however long a stage's name
        line = next(line for line in lines if line.startswith(STAGE_LABELS.get(stage, stage) + " "))
        assert line[:end].endswith(f" {stages['ms_per_pack'][stage]:.1f}"), line


def test_bench_command_json_and_device_decoding(demo, capsys):
    data_yaml = f"{demo['workdir']}/datasets/data.yaml"
    assert main(["bench", data_yaml, "--packs", "2", "--workers", "0", "--decode", "device", "--masks", "none",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["decode"] == "device" and result["stages"]["ms_per_pack"]["masks"] == 0
    assert result["stages"]["ms_per_pack"]["normalise"] == 0 and result["stages"]["ms_per_pack"]["decode"] > 0


def test_bench_leaves_out_torchs_advice_on_worker_counts(tmp_path, capsys, monkeypatch):
    """The worker counts are the user's to choose, and the report names the machine's cores: torch's warning
    that more workers than cores might freeze would be two lines of noise (with a source path) per row."""
    lines = [{"text": "a red cat on the mat"} for _ in range(16)]
    dataset, _ = build("text", [write_jsonl(tmp_path / "docs.jsonl", lines)], tmp_path / "text")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set())  # torch then advises against any worker
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["bench", dataset.prefix, "--seq-length", "8", "--gpt-samples", "16", "--workers", "1",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["workers"] == 1
    assert not [w for w in caught if "worker processes in total" in str(w.message)]


def test_bench_of_text_datasets_reports_gpt_samples(tmp_path, capsys):
    lines = [{"text": " ".join(["a red cat on the mat"] * (1 + row % 5))} for row in range(40)]
    dataset, _ = build("text", [write_jsonl(tmp_path / "docs.jsonl", lines)], tmp_path / "text")
    assert main(["bench", dataset.prefix, "--seq-length", "16", "--gpt-samples", "40", "--workers", "0",
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    (row,) = result["rows"]
    assert result["kind"] == "gpt" and row["samples"] == 32 and row["samples_per_s"] > 0  # 5 batches of 8, 1 untimed
    assert row["tokens_per_s"] == pytest.approx(row["samples_per_s"] * 16)


def test_bench_of_a_dataset_with_fewer_packs_than_asked_lengthens_the_stream(tmp_path, capsys):
    from mmidx.ingest.writer import DatasetBuilder
    from mmidx.sources.elements import Element, StoredImage

    special = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}
    with DatasetBuilder(tmp_path / "one", vocab_size=100, special_tokens=special) as builder:  # one small sample
        builder.add_sample([[5, 6, 7]], [StoredImage(image_bytes(64, 64), 64, 64, "JPEG", "RGB")],
                           [[Element("text", 0), Element("vae_image", 0, loss=True)]])
        builder.finalize()
    for packs in (2, 5):
        assert main(["bench", str(tmp_path / "one"), "--packs", str(packs), "--workers", "0", "--masks", "none",
                     "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["rows"][0]["packs"] == packs - 1 and result["stages"]["packs"] == packs - 1
        assert result["num_packs"] > packs


def test_bench_of_too_few_gpt_samples_says_so_in_one_line(tmp_path, capsys):
    dataset, _ = build("text", [write_jsonl(tmp_path / "docs.jsonl", [{"text": "a red cat"}] * 3)], tmp_path / "t")
    assert main(["bench", dataset.prefix, "--seq-length", "4", "--workers", "0"]) == 1
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "fewer than two batches of 8" in error


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    dataset, _ = build("vlm", [write_jsonl(folder / "sft.jsonl", [row for row, _ in CASES])], folder / "out",
                       image_root=str(folder))
    return dataset


def test_sample_lists_elements_decodes_texts_and_writes_images(vlm, tmp_path, capsys):
    info = describe_sample(vlm.prefix, 0, output_dir=tmp_path / "images")
    assert [e["type"] for e in info["elements"]] == ["text", "vit_image", "text", "vit_image", "text"]
    assert [e["decoded"] for e in info["elements"] if e["type"] == "text"] == ["Compare", "and", "Mountains."]
    assert [e["loss"] for e in info["elements"]] == [0, 0, 0, 0, 1]
    first_text = vlm[0].text(0)
    assert info["elements"][0]["tokens"] == len(first_text) + 2
    assert info["origin"] == {"file": vlm[0].origin[0], "row": 0}
    for image, name in zip(info["images"], ["a.png", "b.png"], strict=True):
        written = tmp_path / "images" / f"sample0_image{image['image']}.png"
        assert written.read_bytes() == FILES[name] and image["format"] == "PNG"
        assert Image.open(written).size == (image["width"], image["height"])
    assert main(["sample", vlm.prefix, "0"]) == 0
    out = capsys.readouterr().out
    assert "Mountains." in out and "vit_image" in out and "row 0" in out and "1 view" in out


def test_sample_shows_extra_json_and_frame_deltas(demo):
    prefix = next(r.data["output"] for r in demo["reports"] if r.data["source"] == "vlm")
    from mmidx.read.dataset import MMIDXDataset

    dataset = MMIDXDataset(prefix)
    video = next(i for i in range(len(dataset)) if "video" in dataset[i].extra)
    info = describe_sample(prefix, video, view=1)
    assert info["extra"]["video"] and info["views"] > 1
    deltas = [e["frame_delta"] for e in info["elements"] if e["type"] == "vit_image"]
    assert deltas == [p.get("frame_delta") for p in dataset[video].sequence_plan(1) if p["type"] == "vit_image"]


def _pack_and_masks(demo, items):
    batch = PackBuilder(demo["config"]).build(0, items)
    split_lens, attn_modes, sample_lens = batch.flat_split_metadata(pad=True)
    return batch, mask_predicate(split_lens, attn_modes, sample_lens, device="cpu"), \
        dense_masks(*batch.flat_split_metadata(pad=False), device="cpu")


def test_show_zoom_panel_samples_the_dense_mask_on_split_scaled_axes(demo):
    batch, predicate, masks = _pack_and_masks(demo, demo["index"].items(0))
    zoom = int(np.argmax([len(s) for s in batch.split_lens]))
    splits = batch.split_lens[zoom]
    edges = split_scaled_edges(splits, 400, 24)
    assert edges[-1] == 400 and np.diff(edges).min() >= 23  # every split visible
    first = sum(batch.sample_lens[:zoom])
    starts = list(first + np.concatenate([[0], np.cumsum(splits)[:-1]]))
    positions = pixel_positions(starts, splits, edges)
    kinds, _ = kinds_of(batch, sum(batch.flat_split_metadata(pad=True)[2]))
    panel = mask_pixels(predicate, positions, kinds)
    local = positions - first
    blocked = torch.isinf(masks[zoom][local[:, None], local[None, :]]).numpy()
    assert ((panel == 255).all(axis=2) == blocked).all()


def test_show_labels_samples_and_crops_padding_of_a_small_pack(demo, tmp_path):
    items = demo["index"].items(0)[:2]
    batch, _, _ = _pack_and_masks(demo, items)
    assert batch.max_num_tokens - batch.sequence_length > batch.sequence_length
    pixels = np.asarray(render(batch, width=600))
    strip = pixels[2 * LINE + 10 + TOP_LABELS + 4, LEFT:600 - 10]
    padding = PALETTE[list(COLOURS).index("padding")]
    assert not (strip == padding).all(axis=1).any()  # cropped: no padding on the axis
    full, _, _ = _pack_and_masks(demo, demo["index"].items(0))
    assert 0 < full.max_num_tokens - full.sequence_length < full.sequence_length
    strip = np.asarray(render(full, width=600))[2 * LINE + 10 + TOP_LABELS + 4, LEFT:600 - 10]
    assert (strip[-1] == padding).all()  # a full pack shows its padding at the end
    labels = pixels[2 * LINE + 10:2 * LINE + 10 + TOP_LABELS - 2, LEFT:600 - 10]
    assert (labels < 128).any()  # sample labels above the key axis
    out = tmp_path / "pack.png"
    assert main(["show", f"{demo['workdir']}/datasets/data.yaml", "-o", str(out), "--width", "512",
                 "--zoom-sample", "1"]) == 0
    assert Image.open(out).size[0] == 512


def test_a_narrow_picture_shortens_the_padding_note_rather_than_cutting_the_header(demo):
    from mmidx.toolkit.show import _font, header

    bold, head = _font(14), "pack 0: 12,345 tokens in 2 samples, 9 splits"
    full = header(head, 24_000, 12_345, True, bold, 1000)
    assert full == head + ", padding 24,000 tokens (not shown: it would fill 66% of the axes)"
    narrow = header(head, 24_000, 12_345, True, bold, 500 - 12)  # --width 500
    assert narrow == head + ", 24,000 padding hidden" and bold.getlength(narrow) <= 488  # whole words, all of it
    assert header(head, 0, 12_345, False, bold, 488) == head
    items = demo["index"].items(0)[:2]
    pixels = np.asarray(render(PackBuilder(demo["config"]).build(0, items), width=512))
    assert (pixels[:LINE, -6:] == 255).all()  # nothing runs into the right edge


# Every subcommand over bad inputs: (argv, exit status). {data} is the demo's data.yaml, {prefix} a vlm
# dataset, {tok} a tokenizer, {file} a regular file, {badyaml} malformed YAML, {empty} an empty YAML.
BAD_INPUTS = [
    (["bench", "/nonexistent/data.yaml"], 1),
    (["bench", "{badyaml}"], 1),
    (["bench", "{data}", "--workers", "1,x"], 2),
    (["bench", "{data}", "--masks", "sparse"], 2),
    (["bench", "{data}", "--packs", "1"], 2),
    (["bench", "{data}", "--packs", "x"], 2),
    (["bench", "{data}", "--target-tokens-per-s", "0"], 2),
    (["bench", "{data}", "--seq-length", "0"], 2),
    (["bench", "{data}", "--gpt-samples", "1"], 2),
    (["sample", "/nonexistent/prefix", "0"], 1),
    (["sample", "{prefix}", "100000"], 1),
    (["sample", "{prefix}", "0", "--view", "7"], 1),
    (["sample", "{prefix}", "0", "-o", "{file}/images"], 1),
    (["sample", "{prefix}", "zero"], 2),
    (["export", "{prefix}", "--to", "wds", "-o", "{tmp}/out"], 1),
    (["export", "{prefix}", "--to", "tsv", "-o", "{tmp}/out"], 2),
    (["export", "/nonexistent/prefix", "--to", "jsonl", "-o", "{tmp}/out"], 1),
    (["export", "{prefix}", "--to", "jsonl", "-o", "{file}/out"], 1),
    (["export", "{prefix}", "--to", "jsonl"], 2),
    (["export", "{prefix}", "--to", "jsonl", "-o", "{tmp}/out", "{tmp}/out2"], 2),
    (["show", "{data}", "--zoom-sample", "99"], 1),
    (["show", "{data}", "--width", "100"], 1),
    (["show", "{data}", "-o", "{tmp}/missing/pack.png"], 1),
    (["show", "{badyaml}"], 1),
    (["show", "{data}", "--pack", "99"], 1),
    (["inspect", "/nonexistent/prefix"], 1),
    (["inspect", "/nonexistent/data.yaml"], 1),
    (["inspect", "{badyaml}"], 1),
    (["inspect", "{empty}", "--json"], 1),
    (["inspect"], 2),
    (["verify", "/nonexistent/prefix"], 1),
    (["verify", "{badyaml}"], 1),
    (["verify", "{empty}"], 1),
    (["verify", "{file}"], 1),
    (["index", "/nonexistent/data.yaml"], 1),
    (["index", "{badyaml}"], 1),
    (["index", "{data}", "--cache-dir", "{file}/cache"], 1),
    (["index", "{data}", "--num-samples", "-1"], 2),
    (["index", "{data}", "--num-samples", "-5"], 2),
    (["index", "{data}", "--max-latent-size", "-64"], 2),
    (["show", "{data}", "--max-num-patch-per-side", "0"], 2),
    (["bench", "{data}", "--max-latent-size", "-64"], 2),
    (["sample", "{prefix}", "-1"], 2),
    (["build", "--source", "text", "--input", "{file}", "--output", "{tmp}/x", "--tokenizer", "{tok}",
      "--workers", "-2"], 2),
    (["build", "--source", "text", "--input", "{file}", "--output", "{tmp}/x", "--tokenizer", "{tok}",
      "--views", "0"], 2),
    (["build", "--source", "text", "--input", "{file}", "--output", "{tmp}/x", "--tokenizer", "{tok}",
      "--num-nodes", "0"], 2),
    (["precache", "{prefix}", "--encoder", "support.encoders:vae", "--name", "x", "--workers", "-2"], 2),
    (["index", "--gpt", "{prefix}", "--seq-length", "16"], 1),
    (["index", "--gpt", "{prefix}"], 2),
    (["index", "{data}", "--seed", "x"], 2),
    (["build", "--config", "/nonexistent/bagel.yaml", "--dataset-info", "{badyaml}", "--output-dir", "{tmp}/o",
      "--tokenizer", "{tok}"], 1),
    (["build", "--config", "{badyaml}", "--dataset-info", "{badyaml}", "--output-dir", "{tmp}/o", "--tokenizer",
      "{tok}"], 1),
    (["build", "--source", "text", "--input", "{file}", "--output", "{file}/sub/x", "--tokenizer", "{tok}",
      "--quiet"], 1),
    (["build", "--source", "text", "--input", "/nonexistent/docs.jsonl", "--output", "{tmp}/x", "--tokenizer",
      "{tok}", "--quiet"], 1),
    (["build", "--source", "text", "--input", "{file}", "--tokenizer", "{tok}"], 2),
    (["build", "--source", "pdf", "--input", "{file}", "--output", "{tmp}/x", "--tokenizer", "{tok}"], 2),
    (["merge", "/nonexistent/shards", "-o", "{tmp}/merged"], 1),
    (["merge", "{prefix}", "-o", "{file}/merged"], 1),
    (["merge", "{tmp}/merged"], 2),
    (["merge", "{prefix}", "-o", "{tmp}/"], 2),
    (["merge", "{prefix}", "-o", "{prefix}"], 1),
    (["precache", "/nonexistent/prefix", "--encoder", "support.encoders:vae", "--name", "x"], 1),
    (["precache", "{prefix}", "--encoder", "no_such_module:vae", "--name", "x"], 1),
    (["precache", "{prefix}", "--encoder", "support.encoders:vae", "--name", "not/a/name"], 1),
    (["precache", "{prefix}", "--encoder", "support.encoders:vae", "--name", "x", "--dtype", "fp8"], 2),
    (["demo", "--workdir", "{file}/demo"], 1),
    (["demo", "--quick", "yes"], 2),
    (["view", "/nonexistent/prefix"], 1),
    (["view", "{badyaml}"], 1),
    (["view", "{data}", "--port", "70000"], 2),
    # object storage (moto's S3 server; {closed}: a local port nothing listens on, {short}: a dataset
    # whose .images object is shorter than its metadata says)
    (["inspect", "s3://no-such-bucket/ds/vlm"], 1),
    (["verify", "s3://mmidx/missing/vlm"], 1),
    (["show", "s3://mmidx/ds/vlm?endpoint_override=127.0.0.1:{closed}&scheme=http"], 1),
    (["index", "--gpt", "s3://mmidx/missing/text", "--seq-length", "16"], 1),
    (["inspect", "{short}"], 1),
    (["fetch", "s3://mmidx/missing/vlm", "-o", "{tmp}/copy"], 1),
    (["fetch", "{short}", "-o", "{tmp}/copy"], 1),
    (["fetch", "{short}"], 2),
    (["precache", "{short}", "--encoder", "support.encoders:vae", "--name", "x"], 1),
    (["build", "--config", "{data}", "--dataset-info", "{data}", "--output-dir", "s3://mmidx/configs",
      "--tokenizer", "{tok}"], 1),
    (["inspect", "{short}", "--cache-limit", "1K"], 1),
    (["sample", "{short}", "0", "--cache-dir", "{file}/cache", "--cache-limit", "1G"], 1),
    (["sample", "{prefix}", "0", "--cache-limit", "lots"], 2),
    (["cache", "info", "{file}"], 1),
    (["cache", "clear", "{file}"], 1),
    (["cache", "info", "{tmp}", "--dataset", "s3://mmidx/ds/vlm"], 2),
    (["cache", "purge"], 2),
]


def bad_input_values(demo, vlm, folder, s3) -> dict[str, str]:
    """The files the table's placeholders name, written in ``folder`` (and in the S3 server)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    short = s3.upload(vlm.prefix, "s3://mmidx/short/vlm")
    s3.client.put_object(Bucket="mmidx", Key="short/vlm.images", Body=open(f"{vlm.prefix}.images", "rb").read()[:-1])
    (folder / "file").write_text("not a folder")
    (folder / "bad.yaml").write_text("groups: [1\n")
    (folder / "empty.yaml").write_text("")
    return {"data": f"{demo['workdir']}/datasets/data.yaml", "prefix": vlm.prefix, "tmp": str(folder),
            "file": str(folder / "file"), "badyaml": str(folder / "bad.yaml"), "empty": str(folder / "empty.yaml"),
            "tok": f"{demo['workdir']}/raw/tokenizer", "closed": str(closed), "short": short}


def test_the_bad_input_table_covers_every_subcommand():
    from mmidx.cli import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert {argv[0] for argv, _ in BAD_INPUTS} == set(commands.choices)


@pytest.mark.parametrize(("argv", "status"), BAD_INPUTS, ids=[" ".join(a[:2]) + f" #{i}" for i, (a, _) in
                                                            enumerate(BAD_INPUTS)])
def test_bad_input_is_one_line_and_an_exit_status(argv, status, demo, vlm, tmp_path, capsys, s3):
    values = bad_input_values(demo, vlm, tmp_path, s3)
    argv = [arg.format(**values) for arg in argv]
    try:
        code = main(argv)
    except SystemExit as exit:  # argparse's usage errors
        code = exit.code
    captured = capsys.readouterr()
    assert code == status
    assert "Traceback" not in captured.out + captured.err
    lines = captured.err.strip().splitlines()
    if status == 1:  # a failure: one line naming what and why (verify: the problem it found)
        # one line naming the command (the one that failed, not just the program), or verify's FAIL
        assert len(lines) == 1 and lines[0].startswith((f"mmidx {argv[0]}: ", "FAIL ")), lines
    else:  # a usage error: argparse's usage, then one line
        assert lines[0].startswith("usage: mmidx") and re.match(r"mmidx( \w+)?: error: ", lines[-1]), lines


def test_the_command_line_ends_in_one_line_in_a_real_process(demo, vlm, tmp_path, s3):
    """What only a process shows: a closed pipe (``inspect --json | head``), the top-level handler, argparse."""
    values = bad_input_values(demo, vlm, tmp_path, s3)
    env = {**os.environ, "PYTHONPATH": str(Path(mmidx.__file__).parent.parent)}
    env.pop("MMIDX_TRACEBACK", None)

    def start(*argv: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "mmidx.cli", *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env=env, text=True)

    piped = start("inspect", "--json", values["prefix"])  # a few kB: still in the buffer at the end
    piped.stdout.close()  # the reader is gone before the command writes a byte
    others = [(start("inspect", values["badyaml"]), 1), (start("show", values["data"], "-o", "/nonexistent/p.png"), 1),
              (start("verify"), 2), (start("inspect", values["short"]), 1), (start("--version"), 0)]
    _, err = piped.communicate(timeout=120)
    assert piped.returncode == 1 and "Traceback" not in err and "Exception ignored" not in err, err
    for process, status in others:
        out, err = process.communicate(timeout=120)
        assert process.returncode == status and "Traceback" not in out + err, (process.args, err)
        if status == 1:
            assert len(err.strip().splitlines()) == 1, err
    assert out.strip() == f"mmidx {mmidx.__version__}"
