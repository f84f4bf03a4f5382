"""The compute a pack costs a transformer: ``pack_costs`` (used to balance data-parallel steps and to
report what a packing wastes).

Cost model (forward FLOPs; backward is a constant multiple, so ratios are unchanged). For a decoder with
hidden size h, L layers, FFN size f (SwiGLU: three h×f matrices), q heads and k key/value heads of
size d = h / q:

- linear work, per token: ``2 L (2 h² + 2 h k d + 3 h f)`` (Q and O, K and V, the MLP);
- attention, per attention segment of n tokens: ``4 L h n²`` (QKᵀ and AV over the full segment).

A pack's cost is the linear work times its tokens plus the attention term summed over its segments (in
mmidx's packs a sample is one attention segment). The figures are a model: the GPU suite times real
packs against it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LLMGeometry:
    """The shape of the language model a pack feeds (default: Qwen2-7B, BAGEL's LLM). Named apart from
    :class:`mmidx.config.ModelGeometry`, which holds the batches' patch and latent grids."""

    hidden_size: int = 3584
    num_layers: int = 28
    ffn_size: int = 18944
    num_heads: int = 28
    num_kv_heads: int = 4

    def __post_init__(self) -> None:
        if min(self.hidden_size, self.num_layers, self.ffn_size, self.num_heads, self.num_kv_heads) < 1:
            raise ValueError(f"every size of the geometry must be positive, got {self}")
        if self.hidden_size % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("hidden_size must divide into num_heads heads, and num_heads into num_kv_heads groups")

    def _flops(self) -> tuple[int, int]:
        """(linear FLOPs per token, attention FLOPs per n²), exact integers: the formula of the module."""
        h, layers = self.hidden_size, self.num_layers
        kv = self.num_kv_heads * (h // self.num_heads)
        return 2 * layers * (2 * h * h + 2 * h * kv + 3 * h * self.ffn_size), 4 * layers * h

    @property
    def linear_flops_per_token(self) -> float:
        """Forward FLOPs of the projections and the MLP for one token."""
        return float(self._flops()[0])

    @property
    def attention_flops_per_square_token(self) -> float:
        """Forward FLOPs of attention per n² of a segment of n tokens."""
        return float(self._flops()[1])

    @property
    def cost_weights(self) -> tuple[int, int]:
        """(linear, attention): the two FLOPs coefficients divided by their greatest common divisor, so a
        sample of n tokens costs ``linear·n + attention·n²`` in small exact integers (Qwen2-7B: 32,512 and 1).
        The tight packer's cost cap compares costs in these units, the same model as :func:`pack_costs`
        without floating point, so its packs are the same on every machine."""
        linear, attention = self._flops()
        divisor = math.gcd(linear, attention)
        return linear // divisor, attention // divisor


QWEN2_7B = LLMGeometry()
"""Qwen2-7B, BAGEL's LLM (``Qwen/Qwen2-7B`` config.json: hidden 3,584, 28 layers, FFN 18,944, 28 heads, 4 KV heads)."""

QWEN2_1_5B = LLMGeometry(hidden_size=1536, num_layers=28, ffn_size=8960, num_heads=12, num_kv_heads=2)
"""Qwen2-1.5B (``Qwen/Qwen2-1.5B`` config.json: hidden 1,536, 28 layers, FFN 8,960, 12 heads, 2 KV heads): 4.98×
fewer linear FLOPs per token than Qwen2-7B."""


def pack_costs(pack_offsets: np.ndarray, segment_tokens: np.ndarray,
               geometry: LLMGeometry | None = None) -> np.ndarray:
    """Forward FLOPs of each pack: pack k holds segments ``segment_tokens[pack_offsets[k]:pack_offsets[k+1]]``
    (token counts, one per attention segment); cost = linear work × Σ n + attention × Σ n² (see the module)."""
    geometry = geometry or LLMGeometry()
    offsets = np.asarray(pack_offsets, dtype=np.int64)
    tokens = np.asarray(segment_tokens, dtype=np.float64)
    if offsets.ndim != 1 or len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(tokens) or np.any(
            np.diff(offsets) < 0):
        raise ValueError("pack_offsets must rise from 0 to len(segment_tokens), one more entry than packs")
    per_segment = geometry.linear_flops_per_token * tokens + geometry.attention_flops_per_square_token * tokens ** 2
    # each pack summed on its own, so its cost is the same float whichever range of packs it is priced with
    costs = np.zeros(len(offsets) - 1)
    held = np.diff(offsets) > 0
    if held.any():
        costs[held] = np.add.reduceat(per_segment, offsets[:-1][held])
    return costs


def deal_by_cost(costs: np.ndarray, world_size: int) -> np.ndarray:
    """Sort-and-deal one global batch: ``costs`` are its packs' costs (in stream order, a multiple of
    ``world_size`` of them); returns the packs' order (indices into ``costs``) such that micro-step j
    runs entries ``j*world_size : (j+1)*world_size`` side by side, rank r taking the r-th. Packs are
    sorted by cost, dearest first (ties by stream order), so packs that run together cost alike.
    A pure function of (costs, world_size): every rank computes the same deal."""
    costs = np.asarray(costs, dtype=np.float64)
    if world_size < 1 or len(costs) % world_size:
        raise ValueError(f"a global batch of {len(costs)} packs does not divide among {world_size} ranks")
    return np.lexsort((np.arange(len(costs)), -costs))


def step_balance(costs: np.ndarray, global_batch_size: int, world_size: int, *, balanced: bool) -> float:
    """Mean over micro-steps of (mean rank cost ÷ slowest rank's cost): the share of GPU time not spent
    waiting for the slowest rank, for the complete global batches of ``costs`` (one per pack, in pack
    order), ranks taking contiguous shares (``balanced=False``) or :func:`deal_by_cost`'s deal."""
    costs = np.asarray(costs, dtype=np.float64)
    if global_batch_size % world_size:
        raise ValueError(f"global_batch_size {global_batch_size} must be a multiple of world size {world_size}")
    batches = costs[: len(costs) // global_batch_size * global_batch_size].reshape(-1, global_batch_size)
    if not len(batches):
        return 1.0
    per_rank = global_batch_size // world_size
    if balanced:
        batches = np.stack([batch[deal_by_cost(batch, world_size)] for batch in batches])
        steps = batches.reshape(-1, per_rank, world_size)  # [batch, micro-step, rank]
    else:
        steps = batches.reshape(-1, world_size, per_rank).transpose(0, 2, 1)
    steps = steps.reshape(-1, world_size)
    slowest = steps.max(axis=1)
    return float(np.mean(np.where(slowest > 0, steps.mean(axis=1) / np.where(slowest > 0, slowest, 1), 1.0)))
