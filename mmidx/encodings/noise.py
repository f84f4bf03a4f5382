"""The posterior noise of precached VAE moments, drawn where the batch lives, the same on any device.

A pack whose latents are stored as moments ships them (bf16, zero-padded) with its key (seed, pack);
:func:`sample_latents` draws ``mean + exp(logvar / 2) * noise`` when the batch reaches its device
(``PackedBatch.to``/``cuda``, or ``to_dict`` where it is), so loader workers spend nothing on it.

The noise is counter-based: normal ``e`` of VAE slot ``s`` of pack ``k`` is a Box-Muller transform
(float32) of the Philox4x32-10 block (Salmon et al., Random123) with key ``(seed mod 2^32, seed >>
32)`` and counter ``(e // 4, s, k mod 2^32, k >> 32)``: lane pairs (0, 1) and (2, 3) give normals
``4j, 4j+1`` and ``4j+2, 4j+3`` as (r cos θ, r sin θ), r = sqrt(-2 ln u1), θ = 2π u2, with u1 = (x0 >> 8
+ 1) / 2^24 and u2 = (x1 >> 8) / 2^24. Philox runs in int64 torch arithmetic without overflow (16-bit
limbs), so the integers are identical on every device; the float32 transcendental functions of two
devices may differ in the last bit, so CPU and GPU draws agree to float32 rounding. A pure function of
(config, seed, pack, slot, the latent's shape): the same in any process, worker or resumed run.
"""

from __future__ import annotations

import math

import torch

MASK32 = 0xFFFFFFFF
_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_WEYL = (0x9E3779B9, 0xBB67AE85)
CPU_CHUNK = 16384  # blocks per step on a CPU: ~20 int64 ops a round stay in cache (2.7x faster than one sweep)


def _mulhilo(multiplier: int, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of ``multiplier * value`` (value < 2^32, int64), with no int64 overflow."""
    low_limb, high_limb = value & 0xFFFF, value >> 16
    a, b = low_limb * multiplier, high_limb * multiplier  # each < 2^48
    t = a + ((b & 0xFFFF) << 16)
    return (b >> 16) + (t >> 32), t & MASK32


def philox4x32(counter: list[torch.Tensor], key: tuple[int, int], rounds: int = 10) -> list[torch.Tensor]:
    """Philox4x32-``rounds`` of the counters (four int64 tensors of values < 2^32) under ``key``: four int64
    tensors of uint32 values."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        hi0, lo0 = _mulhilo(_MULTIPLIERS[0], c0)
        hi1, lo1 = _mulhilo(_MULTIPLIERS[1], c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + _WEYL[0]) & MASK32, (k1 + _WEYL[1]) & MASK32
    return [c0, c1, c2, c3]


def _normals(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    u1 = ((x >> 8) + 1).to(torch.float32) * 2.0**-24
    u2 = (y >> 8).to(torch.float32) * 2.0**-24
    radius = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2 * math.pi) * u2
    return radius * torch.cos(angle), radius * torch.sin(angle)


def _block_normals(counter: list[torch.Tensor], key: tuple[int, int]) -> torch.Tensor:
    """The four normals of each Philox block, block j's at 4j..4j+3."""
    x0, x1, x2, x3 = philox4x32(counter, key)
    z0, z1 = _normals(x0, x1)
    z2, z3 = _normals(x2, x3)
    return torch.stack([z0, z1, z2, z3], dim=1).view(-1)


def slot_noise(seed: int, pack: int, sizes: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """(n, channels, height, width) float32 on ``sizes``' device: slot s's normals (the module's rule) in its
    top-left ``sizes[s]`` = (h, w) latent, zeros elsewhere."""
    device = sizes.device
    sizes = sizes.to(torch.int64)
    counts = channels * sizes[:, 0] * sizes[:, 1]
    blocks = (counts + 3) // 4
    slots = torch.arange(len(sizes), device=device)
    block_slot = torch.repeat_interleave(slots, blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    block = torch.arange(len(block_slot), device=device) - first_block[block_slot]
    zeros = torch.zeros_like(block)
    key = (seed & MASK32, (seed >> 32) & MASK32)
    counter = [block, block_slot, zeros + (pack & MASK32), zeros + (pack >> 32)]
    step = CPU_CHUNK if device.type == "cpu" else max(1, len(block))
    normals = torch.cat([_block_normals([part[start:start + step] for part in counter], key)
                         for start in range(0, len(block), step)] or [torch.zeros(0, device=device)])
    noise = torch.zeros(len(sizes), channels, height, width, dtype=torch.float32, device=device)
    for slot, ((h, w), start, count) in enumerate(zip(sizes.tolist(), (4 * first_block).tolist(), counts.tolist(),
                                                     strict=True)):
        noise[slot, :, :h, :w] = normals[start:start + count].view(channels, h, w)
    return noise


def sample_latents(moments: torch.Tensor, sizes: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``padded_latent`` (n, C, H, W) float32 from zero-padded moments (n, 2, C, H, W) = (mean, logvar), the
    latent sizes (n, 2) and the pack's key (seed, pack), computed on the moments' device."""
    seed, pack = (int(value) for value in key.tolist())
    _, _, channels, height, width = moments.shape
    noise = slot_noise(seed, pack, sizes, channels, height, width)
    mean, logvar = (moments[:, part].to(torch.float32, copy=True) for part in (0, 1))
    return mean.add_(torch.exp(logvar.mul_(0.5)).mul_(noise))  # zeros in the padding: 0 + e^0 * 0
