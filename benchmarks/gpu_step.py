"""The training step the GPU suite times (items 5 and 6 of ``gpu_suite.py``): Qwen2 decoder layers with a pack's
attention, and the step mmidx's loader feeds.

Item 6 (issue 42) measures what MLPerf Storage reports for a data loader, accelerator utilisation: the time the
accelerator computes ÷ wall time. :class:`FedStack` is BAGEL's forward up to its language model, in miniature:
the packed sequence assembled from a batch's tensors, then decoder layers of Qwen2-7B's width. Each step is
forward, backward and an AdamW step (:func:`train_step`). :func:`timed_steps` runs it on packs as they come
(``streamed``: from a :class:`~mmidx.train.loader.PackLoader`, the mask built per step on the device) or on packs
already there (``resident``); the suite divides the two times over the same packs.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._dynamo.utils import counters

QWEN2_VOCAB = 152064  # Qwen2-7B's embedding rows (BAGEL's tokenizer adds its special tokens inside them)

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def compiled_flex() -> Callable[..., torch.Tensor]:
    """One compiled FlexAttention for every item that trains through it (items 5 and 6): a pack length that one
    item compiled is not compiled again by the next."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def full_mask(masks: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The whole pack's additive (n, n) mask from its per-sample dense masks (``mmidx.pack.masks.dense_masks``):
    each on the diagonal, -inf between samples. SDPA with it is the pack's attention where FlexAttention has no
    backward (on a CPU)."""
    n = sum(len(mask) for mask in masks)
    full = torch.full((n, n), float("-inf"), dtype=dtype, device=masks[0].device)
    start = 0
    for mask in masks:
        full[start:start + len(mask), start:start + len(mask)] = mask
        start += len(mask)
    return full


def flex_attend(blocks: Any, flex: Callable[..., torch.Tensor] | None = None) -> Attend:
    """Attention through FlexAttention with the pack's ``BlockMask`` (grouped heads): ``flex``, by default
    :func:`compiled_flex` (eager ``flex_attention`` is the reference path on a CPU)."""
    flex = flex or compiled_flex()
    return lambda q, k, v: flex(q, k, v, block_mask=blocks, enable_gqa=True)


def dense_attend(mask: torch.Tensor) -> Attend:
    """Attention through SDPA with the pack's whole additive mask (:func:`full_mask`; grouped heads)."""
    return lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class DecoderLayer(torch.nn.Module):
    """One Qwen2 decoder layer of ``geometry``'s size: RMSNorm, grouped-query attention (biased Q/K/V) through
    FlexAttention with a pack's BlockMask, RMSNorm, SwiGLU MLP. Rotary embeddings are left out (elementwise
    work, a rounding error of the layer's time next to its matrix products and attention)."""

    def __init__(self, geometry: Any) -> None:
        super().__init__()
        torch.manual_seed(0)
        hidden, self.head_dim = geometry.hidden_size, geometry.hidden_size // geometry.num_heads
        self.heads, self.kv_heads = geometry.num_heads, geometry.num_kv_heads
        self.norm1, self.norm2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.qkv = torch.nn.Linear(hidden, (self.heads + 2 * self.kv_heads) * self.head_dim)
        self.o = torch.nn.Linear(hidden, hidden, bias=False)
        self.gate_up = torch.nn.Linear(hidden, 2 * geometry.ffn_size, bias=False)
        self.down = torch.nn.Linear(geometry.ffn_size, hidden, bias=False)

    def forward(self, x: torch.Tensor, attend: Attend) -> torch.Tensor:
        """``attend(q, k, v)``: the pack's masked attention (FlexAttention with its BlockMask, grouped heads)."""
        n = x.shape[1]
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q, k, v = (t.view(1, n, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        out = attend(q, k, v)
        x = x + self.o(out.transpose(1, 2).reshape(1, n, -1))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(torch.nn.functional.silu(gate) * up)


class FedStack(torch.nn.Module):
    """BAGEL's forward (``modeling/bagel/bagel.py``) up to its language model, then ``geometry.num_layers``
    decoder layers.

    The packed sequence of ``length`` tokens is assembled from the batch as BAGEL assembles it: text embeddings
    (a frozen table of Qwen2's vocabulary) at ``packed_text_indexes``, ViT patches (``packed_vit_tokens``) at
    ``packed_vit_token_indexes`` and VAE-grid patches of ``padded_images`` (one per ``vae_stride`` pixels, as
    ``patchified_vae_latent_shapes`` counts them) at ``packed_vae_token_indexes``, each through one trained
    linear map standing in for SigLIP + connector and for the VAE + ``vae2llm``. Padding stays zero. The loss
    stands in for BAGEL's CE and MSE: the mean square of the last hidden state.
    """

    def __init__(self, geometry: Any, vit_patch_size: int, vae_stride: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        hidden = geometry.hidden_size
        self.vae_stride = vae_stride
        self.embed = torch.nn.Embedding(QWEN2_VOCAB, hidden).requires_grad_(False)
        self.vit = torch.nn.Linear(3 * vit_patch_size ** 2, hidden)
        self.vae = torch.nn.Linear(3 * vae_stride ** 2, hidden)
        self.layers = torch.nn.ModuleList(DecoderLayer(geometry) for _ in range(geometry.num_layers))

    def sequence(self, tensors: dict[str, Any], length: int) -> torch.Tensor:
        """The (1, length, hidden) packed sequence of one batch's tensors."""
        text = self.embed(tensors["packed_text_ids"])
        sequence = text.new_zeros(length, text.shape[1])
        sequence[tensors["packed_text_indexes"]] = text
        if "packed_vit_tokens" in tensors:
            vit = tensors["packed_vit_tokens"]
            sequence[tensors["packed_vit_token_indexes"]] = self.vit(vit.to(sequence.dtype))
        if "padded_images" in tensors:
            p = self.vae_stride
            patches = [image[:, :h * p, :w * p].reshape(3, h, p, w, p).permute(1, 3, 0, 2, 4).reshape(h * w, -1)
                       for image, (h, w) in zip(tensors["padded_images"], tensors["patchified_vae_latent_shapes"],
                                                strict=True)]
            sequence[tensors["packed_vae_token_indexes"]] = self.vae(torch.cat(patches).to(sequence.dtype))
        return sequence[None]

    def forward(self, tensors: dict[str, Any], length: int, attend: Attend) -> torch.Tensor:
        x = self.sequence(tensors, length)
        for layer in self.layers:
            x = layer(x, attend)
        return x.float().square().mean()


def train_step(model: FedStack, optimizer: torch.optim.Optimizer, tensors: dict[str, Any], length: int,
               attend: Attend) -> torch.Tensor:
    """Forward, backward and one optimizer step; the loss stays on the device (reading it would wait for it)."""
    optimizer.zero_grad(set_to_none=True)
    loss = model(tensors, length, attend)
    loss.backward()
    optimizer.step()
    return loss.detach()


@dataclass
class Fed:
    """One pack as the step takes it: the batch on the device (a ``PackedBatch``), the length of its packed
    sequence, and its attention (the pack's masks, built)."""

    batch: Any
    length: int
    attend: Attend


@dataclass
class Run:
    """A timed run: wall seconds over ``steps`` steps (the device drained at both ends), the frames compiled
    during them (a recompilation would be timed), the host's seconds in each phase of the loop, the packs it ran
    (for a resident run after it) and every step's loss."""

    steps: int = 0
    seconds: float = 0.0
    compiled: int = 0
    host: dict[str, float] = field(default_factory=lambda: {"next batch": 0.0, "masks": 0.0, "step issued": 0.0})
    packs: list[Fed] = field(default_factory=list)
    losses: list[torch.Tensor] = field(default_factory=list)


def timed_steps(packs: Iterator[Any], prepare: Callable[[Any], Fed], steps: int, warmup: int,
                step: Callable[[Fed], torch.Tensor], sync: Callable[[], None]) -> Run:
    """``warmup`` untimed steps, then ``steps`` timed ones, each on the next of ``packs`` turned into a
    :class:`Fed` by ``prepare`` (for a streamed run: the loader's batch and the masks mmidx builds for it;
    for a resident run: the pack itself). The clock starts and stops with the device drained, so the time is
    what the device took for the timed steps, waits for data included; the host's time in each phase is
    summed alongside (where the host waits while the device is idle, the step is held back)."""
    run = Run()
    for _ in range(warmup):
        fed = prepare(next(packs))
        run.packs.append(fed)
        run.losses.append(step(fed))
    sync()
    frames = counters["frames"]["total"]
    start = time.perf_counter()
    for _ in range(steps):
        began = time.perf_counter()
        pack = next(packs)
        got = time.perf_counter()
        fed = prepare(pack)
        prepared = time.perf_counter()
        run.losses.append(step(fed))
        run.host["next batch"] += got - began
        run.host["masks"] += prepared - got
        run.host["step issued"] += time.perf_counter() - prepared
        run.packs.append(fed)
    sync()
    run.seconds, run.steps = time.perf_counter() - start, steps
    run.compiled = counters["frames"]["total"] - frames
    return run


def replayed(streamed: Run, warmup: int) -> list[Fed]:
    """The packs of a resident run after ``streamed`` (which took ``warmup`` untimed steps): its first pack for
    one warm-up step, then the packs it timed, in its order."""
    return [streamed.packs[0], *streamed.packs[warmup:]]
