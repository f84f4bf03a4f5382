"""An emulated accelerator's time per pack: the cost model's FLOPs (:mod:`mmidx.index.cost`) turned into seconds
by a stated throughput, for ``mmidx bench --au`` (an accelerator that sleeps its micro-batch's compute time, as
MLPerf Storage emulates one).

A model is a named geometry (:data:`MODELS`). Its throughput is one of:

- tokens per second of one accelerator on packs of average cost (``--tokens-per-s``, or the model's default,
  printed with its source): seconds per FLOP = 1 / (tokens/s × the config's mean FLOPs per token), so a pack of
  the config's mean cost per token and n tokens takes n ÷ (tokens/s), a dearer one longer;
- a calibration file (``--calibration``), which the GPU suite's cost-model item writes
  (``benchmarks/gpu_suite.py``): seconds per FLOP measured on real packs.

Calibration file (JSON; :func:`write_calibration` writes it, :func:`read_calibration` reads and checks it)::

    {"format": "mmidx-cost-calibration", "version": 1,
     "seconds_per_flop": 2.1e-15,     # forward+backward seconds per forward FLOP of pack_costs
     "layer": {"hidden_size": 3584, "ffn_size": 18944, "num_heads": 28, "num_kv_heads": 4},
     "attention": "flex",             # the attention kernel timed: "flex" (FlexAttention) or "sdpa"
     "device": "NVIDIA H100 80GB HBM3", "packs": 150, "correlation": 0.998, "source": "..."}

The cost model is linear in the number of layers, so seconds per FLOP measured on one layer holds for a model of
that layer's shape with any number of layers (embeddings, the LM head and BAGEL's ViT and VAE are not modelled).
A calibration is refused for a model whose layer has another shape: small matrices run at a lower FLOP rate.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mmidx.errors import MMIDXError, option
from mmidx.index.cost import QWEN2_1_5B, QWEN2_7B, LLMGeometry
from mmidx.io.files import write_json

CALIBRATION_FORMAT = "mmidx-cost-calibration"
CALIBRATION_VERSION = 1
ATTENTION = ("flex", "sdpa")  # FlexAttention (a BlockMask), or SDPA (dense masks, FlashAttention-class kernels)
LAYER_FIELDS = ("hidden_size", "ffn_size", "num_heads", "num_kv_heads")


class DemandError(MMIDXError, ValueError):
    """A throughput or calibration that cannot give an accelerator's time per pack."""


@dataclass(frozen=True)
class Model:
    """A named model: its geometry (and where it comes from) and its default tokens/s per accelerator, per
    attention kernel, each with its source."""

    name: str
    geometry: LLMGeometry
    geometry_source: str
    tokens_per_s: dict[str, float]
    tokens_per_s_source: dict[str, str]


_RATIO_1_5B = QWEN2_7B.linear_flops_per_token / QWEN2_1_5B.linear_flops_per_token  # 4.98
_SAME_FLOPS = (f"qwen2-7b's × {_RATIO_1_5B:.2f} (its linear FLOPs per token over Qwen2-1.5B's), at the same FLOPs "
               "per second: a small model usually runs at a lower MFU, so this overstates its demand a little")

MODELS: dict[str, Model] = {
    "qwen2-7b": Model(
        "qwen2-7b", QWEN2_7B, "Qwen/Qwen2-7B config.json (BAGEL's LLM)",
        {"sdpa": 9600.0, "flex": 5615.0},
        {"sdpa": "a 7B model on one H100, fms-fsdp's README (foundation-model-stack/fms-fsdp#89)",
         "flex": "Llama3-8B with FlexAttention on H100s (pytorch/torchtitan#1884)"}),
    "qwen2-1.5b": Model(
        "qwen2-1.5b", QWEN2_1_5B, "Qwen/Qwen2-1.5B config.json",
        {"sdpa": 9600.0 * _RATIO_1_5B, "flex": 5615.0 * _RATIO_1_5B},
        {"sdpa": _SAME_FLOPS, "flex": _SAME_FLOPS}),
}


@dataclass(frozen=True)
class Demand:
    """How fast one emulated accelerator computes: ``seconds_per_flop`` (forward+backward seconds per forward FLOP
    of :func:`~mmidx.index.cost.pack_costs` at ``geometry``), the tokens/s that is on packs of the config's average
    cost, and where the figure comes from."""

    model: str
    geometry: LLMGeometry
    seconds_per_flop: float
    tokens_per_s: float
    source: str

    def seconds(self, flops: float | np.ndarray) -> Any:
        """The time an accelerator computes a micro-batch of ``flops`` forward FLOPs (pack_costs)."""
        return flops * self.seconds_per_flop

    def describe(self) -> dict[str, Any]:
        return {"model": self.model, "tokens_per_s": self.tokens_per_s, "seconds_per_flop": self.seconds_per_flop,
                "source": self.source}


def demand(model: str, mean_flops_per_token: float, *, tokens_per_s: float | None = None, attention: str = "flex",
           calibration: str | os.PathLike | None = None) -> Demand:
    """The demand of one accelerator training ``model`` on packs whose mean forward FLOPs per token (pack_costs
    at the model's geometry, summed over the config's packs ÷ their tokens) is ``mean_flops_per_token``: from
    ``tokens_per_s``, else from ``calibration`` (a file :func:`write_calibration` wrote), else the model's default
    for ``attention`` ("flex" or "sdpa")."""
    if model not in MODELS:
        raise DemandError(f"unknown model {model!r}: one of {', '.join(MODELS)}")
    if attention not in ATTENTION:
        raise DemandError(f"attention is one of {', '.join(ATTENTION)}, not {attention!r}")
    if not (math.isfinite(mean_flops_per_token) and mean_flops_per_token > 0):
        raise DemandError(f"the packs' mean FLOPs per token must be positive, got {mean_flops_per_token}")
    known = MODELS[model]
    if tokens_per_s is not None and calibration is not None:
        raise DemandError(f"give {option('tokens_per_s')} or {option('calibration')}, not both")
    if calibration is not None:
        measured = read_calibration(calibration, known.geometry)
        seconds_per_flop = measured["seconds_per_flop"]
        source = (f"calibration {os.fspath(calibration)} ({measured['attention']} attention on "
                  f"{measured.get('device', 'an unnamed device')})")
        return Demand(model, known.geometry, seconds_per_flop, 1 / (seconds_per_flop * mean_flops_per_token), source)
    if tokens_per_s is None:
        tokens_per_s, source = known.tokens_per_s[attention], known.tokens_per_s_source[attention]
    else:
        source = "given (--tokens-per-s)"
    if not (math.isfinite(tokens_per_s) and tokens_per_s > 0):
        raise DemandError(f"tokens per second must be a positive number, got {tokens_per_s}")
    return Demand(model, known.geometry, 1 / (tokens_per_s * mean_flops_per_token), float(tokens_per_s), source)


def write_calibration(path: str | os.PathLike, seconds_per_flop: float, layer: LLMGeometry, *, attention: str,
                      **about: Any) -> None:
    """Write the calibration file (the module's format) for a layer of ``layer``'s shape; ``about``: what else to
    record (device, packs, correlation, source)."""
    if not (math.isfinite(seconds_per_flop) and seconds_per_flop > 0):
        raise DemandError(f"seconds per FLOP must be a positive number, got {seconds_per_flop}")
    if attention not in ATTENTION:
        raise DemandError(f"attention is one of {', '.join(ATTENTION)}, not {attention!r}")
    shape = {name: value for name, value in asdict(layer).items() if name in LAYER_FIELDS}
    write_json(path, {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                      "seconds_per_flop": seconds_per_flop, "layer": shape, "attention": attention, **about})


def read_calibration(path: str | os.PathLike, geometry: LLMGeometry) -> dict[str, Any]:
    """A calibration file's fields, checked: its format and version, a positive seconds per FLOP, and a layer of
    ``geometry``'s shape (any number of layers)."""
    try:
        with open(path) as file:
            fields = json.load(file)
    except json.JSONDecodeError as error:
        raise DemandError(f"{os.fspath(path)}: not a calibration file (not JSON: {error})") from error
    if not isinstance(fields, dict) or fields.get("format") != CALIBRATION_FORMAT:
        raise DemandError(f"{os.fspath(path)}: not a calibration file (format is not {CALIBRATION_FORMAT!r}); "
                          "benchmarks/gpu_suite.py --items cost_model writes one")
    if fields.get("version") != CALIBRATION_VERSION:
        raise DemandError(f"{os.fspath(path)}: calibration version {fields.get('version')!r}, this mmidx reads "
                          f"version {CALIBRATION_VERSION}")
    value = fields.get("seconds_per_flop")
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise DemandError(f"{os.fspath(path)}: seconds_per_flop must be a positive number, got {value!r}")
    if fields.get("attention") not in ATTENTION:
        raise DemandError(f"{os.fspath(path)}: attention must be one of {', '.join(ATTENTION)}, "
                          f"got {fields.get('attention')!r}")
    want = {name: value for name, value in asdict(geometry).items() if name in LAYER_FIELDS}
    if fields.get("layer") != want:
        raise DemandError(f"{os.fspath(path)} was measured on a layer of {fields.get('layer')!r}, not the model's "
                          f"{want}: calibrate this model (benchmarks/gpu_suite.py --items cost_model --model NAME)")
    return fields
