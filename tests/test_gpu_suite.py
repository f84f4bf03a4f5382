"""The GPU suite (benchmarks/gpu_suite.py) runs end to end on the CPU, so it cannot rot before a GPU runs it.

Its ``--quick`` CPU run exercises every item (masks, device decode, latents, feeding, the cost model's layer
timing) and every CPU-side equality it checks; the CUDA side is tests/test_gpu_cuda.py's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from bench_masks import ALL_KINDS, bagel_pack  # noqa: E402
from gpu_suite import Item, bagel_step_tokens_per_s, markdown  # noqa: E402

from mmidx.index.accelerator import read_calibration  # noqa: E402
from mmidx.index.cost import LLMGeometry  # noqa: E402


def test_the_quick_cpu_run_passes_every_item_and_writes_both_reports(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "gpu_suite.py"), str(out), "--device", "cpu", "--quick",
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=600,
                          cwd=BENCHMARKS.parent)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    report = json.loads((out / "report.json").read_text())
    items = {item["name"]: item for item in report["items"]}
    assert list(items) == ["masks", "decode", "latents", "feed", "cost_model"]
    for name in ("masks", "decode", "latents", "feed", "cost_model"):
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
    text = (out / "report.md").read_text()
    assert "## masks — ok" in text and "| pack | samples |" in text and "FAIL" not in text


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
