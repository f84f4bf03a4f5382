"""The GPU suite (benchmarks/gpu_suite.py) runs end to end on the CPU, so it cannot rot before a GPU runs it.

Its ``--quick`` CPU run exercises every item (masks, device decode, latents, feeding, the cost model's layer
timing, the step it feeds) and every CPU-side equality it checks; the CUDA side is tests/test_gpu_cuda.py's.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_masks import ALL_KINDS, bagel_pack  # noqa: E402
from gpu_step import Fed, replayed, timed_steps  # noqa: E402
from gpu_suite import DECODE_STATES, Item, bagel_step_tokens_per_s, decode_exactness, markdown  # noqa: E402

from mmidx.index.accelerator import read_calibration  # noqa: E402
from mmidx.index.cost import LLMGeometry  # noqa: E402

BAGEL_SRC = os.environ.get("MMIDX_BAGEL_SRC")
ITEMS = ["masks", "decode", "latents", "feed", "cost_model", "step"]
STEP_FIGURES = ["packs timed on each side", "tokens a pack (mean: its samples; the sequence run)", "step ms, streamed",
                "step ms, resident", "utilisation = resident ÷ streamed", "held back: (streamed - resident) ÷ streamed",
                "mmidx's block_mask ms a step (2 of the packs, device drained around each)",
                "  its share of the streamed step (at most: as if it overlapped nothing)",
                "host ms a streamed step: next batch", "host ms a streamed step: masks",
                "host ms a streamed step: step issued", "host ms a resident step: step issued",
                "utilisation at 28 layers (lower bound: the streamed excess kept per step)",
                "model TFLOP/s of the resident step (3 × pack_costs)"]


@pytest.mark.timeout(900)  # over half the default: its subprocess has 600 s, all used at a load of 20
def test_the_quick_cpu_run_passes_every_item_and_writes_both_reports(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), str(out), "--device", "cpu", "--quick",
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=600,
                          cwd=BENCHMARKS.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    items = {item["name"]: item for item in report["items"]}
    assert list(items) == ITEMS
    for name in ITEMS:
        assert items[name]["status"] == "ok", items[name]
        assert items[name]["checks"] and all(check["passed"] for check in items[name]["checks"]), items[name]
        assert items[name]["rows"]
    assert [row[0] for row in items["masks"]["rows"]] == list(ALL_KINDS)
    assert [row[0] for row in items["cost_model"]["rows"]][:-1] == [*ALL_KINDS, "all"]
    assert "correlation" in items["cost_model"]["rows"][-1][0]
    # the cost model's fit, as the file mmidx bench --au --calibration reads (a quick run times a small layer)
    small = LLMGeometry(hidden_size=64, num_layers=28, ffn_size=128, num_heads=4, num_kv_heads=2)
    calibration = read_calibration(out / "calibration.json", small)
    assert calibration["seconds_per_flop"] > 0 and calibration["packs"] == len(ALL_KINDS)
    exactness = [check for check in items["decode"]["checks"] if "caller's stream" in check["name"]]
    assert [check["name"].split("stream ")[1].split(":")[0] for check in exactness] == list(DECODE_STATES)
    assert all(check["detail"].startswith("0 of 3 iterations differ in pixels, 0 damaged") for check in exactness)
    assert any("every pixel of 8 JPEGs: 0 of" in note for note in items["decode"]["notes"])  # PIL on both sides
    figures = dict(items["step"]["rows"])
    assert list(figures) == STEP_FIGURES, list(figures)
    streamed, resident = float(figures["step ms, streamed"]), float(figures["step ms, resident"])
    assert min(streamed, resident) > 0
    assert float(figures["utilisation = resident ÷ streamed"]) == pytest.approx(resident / streamed, rel=1e-3)
    samples, sequence = map(float, figures["tokens a pack (mean: its samples; the sequence run)"].split("; "))
    assert 0 < samples == sequence <= 3072  # dense masks on a CPU: the samples alone, unpadded
    assert figures["packs timed on each side"].startswith("2 (2 rounds of 1")
    assert any("no --bagel-src" in note for note in items["step"]["notes"])
    text = (out / "report.md").read_text()
    assert "## masks — ok" in text and "| pack | samples |" in text and "FAIL" not in text
    assert "## step — ok" in text and "| utilisation = resident ÷ streamed |" in text


def test_decode_exactness_counts_the_iterations_that_differ_in_a_single_pixel():
    from PIL import Image

    from mmidx.images.device import decode_jpeg_batch

    datas = []
    for seed in range(2):
        image = Image.effect_noise((48, 32), 40 + seed).convert("RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG")
        datas.append(np.frombuffer(buffer.getvalue(), dtype=np.uint8))
    reference = decode_jpeg_batch(datas, "cpu")
    calls = []

    def flips_one_pixel_every_other_call(datas, device):
        decoded = decode_jpeg_batch(datas, device)
        calls.append(device)
        if len(calls) % 2 == 0:
            decoded[1][2, 31, 47] ^= 1  # the last pixel of the second image, one level
        return decoded

    for state in DECODE_STATES:
        calls.clear()
        counts = decode_exactness(datas, reference, "cpu", state, 6, lambda: None, flips_one_pixel_every_other_call)
        assert counts == {"iterations": 6, "pixels differ": 3, "memory damaged": 0, "inexact": 3}
        assert decode_exactness(datas, reference, "cpu", state, 2, lambda: None) == \
            {"iterations": 2, "pixels differ": 0, "memory damaged": 0, "inexact": 0}


def test_a_resident_run_replays_the_packs_the_streamed_run_timed():
    taken = []

    def step(pack):
        taken.append(pack.batch)
        return torch.zeros(())

    streamed = timed_steps(iter(range(10)), lambda k: Fed(k, 1, None), 4, 3, step, lambda: None)
    assert [pack.batch for pack in streamed.packs] == taken == list(range(7))
    assert streamed.steps == 4 and streamed.seconds > 0 and streamed.compiled == 0 and len(streamed.losses) == 7
    taken.clear()
    resident = timed_steps(iter(replayed(streamed, 3)), lambda pack: pack, 4, 1, step, lambda: None)
    assert taken == [0, 3, 4, 5, 6]  # one warm-up, then the 4 packs the streamed run timed, in its order
    assert [pack.batch for pack in resident.packs[1:]] == [pack.batch for pack in streamed.packs[3:]]


@pytest.mark.skipif(not BAGEL_SRC, reason="set MMIDX_BAGEL_SRC to a ByteDance-Seed/Bagel checkout (or a folder holding "
                                           "its data/__init__.py and data/data_utils.py) to rehearse the comparison")
def test_the_step_times_bagels_per_forward_block_mask_on_the_fed_packs(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), str(out), "--device", "cpu", "--quick",
                           "--items", "step", "--bagel-src", BAGEL_SRC, "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600, cwd=BENCHMARKS.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    (step,) = json.loads((out / "report.json").read_text())["items"]
    assert {"name": "on the fed packs, mmidx's BlockMask = BAGEL's, every block list", "passed": True,
            "detail": "2 packs"} in step["checks"]
    figures = dict(step["rows"])
    bagel, resident = float(figures["BAGEL's create_block_mask ms a step (H=4, the same packs)"]), \
        float(figures["step ms, resident"])
    share = float(figures["  its share of this step (÷ resident step + it)"].rstrip("%"))
    assert share == pytest.approx(100 * bagel / (resident + bagel), abs=0.02)
    assert "  its share of a 28-layer step" in figures


def test_a_failing_item_is_recorded_and_the_report_says_so():
    item = Item("masks", status="error", error="RuntimeError: boom")
    item.check("something", False, "why")
    text = markdown({"device": "cpu"}, [item, Item("decode")])
    assert "## masks — error" in text and "RuntimeError: boom" in text and "FAIL: something (why)" in text
    assert "## decode — ok" in text


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_every_pack_kind_fills_its_length_with_whole_samples(kind):
    split_lens, attn_modes, sample_lens = bagel_pack(kind, 4096, seed=1)
    assert sum(split_lens) == sum(sample_lens) == 4096 and len(split_lens) == len(attn_modes)
    assert len(sample_lens) >= 2 and set(attn_modes) <= {"causal", "full", "noise"}
    if kind in ("t2i", "video"):
        assert "noise" in attn_modes


def test_a_pack_too_short_for_any_sample_is_refused():
    with pytest.raises(ValueError, match="no video sample fits"):
        bagel_pack("video", 1024)


def test_the_bagel_step_consumes_fewer_tokens_when_attention_is_longer():
    # 989 TFLOP/s at 40%: 6 · 7.6e9 FLOPs a token alone give ~8,700 tokens/s
    assert 8_000 < bagel_step_tokens_per_s(989, 0) < 9_000
    assert bagel_step_tokens_per_s(989, 4096) < bagel_step_tokens_per_s(989, 1024)
