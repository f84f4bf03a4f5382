"""CFG dropout as a pack draws it: which elements of a pack's samples are dropped, a pure function of (seed, pack,
sample position, element) and the plan records.

Each sample of a pack draws its randomness from Philox keyed by the config's seed, its counter ``[0, 0, position,
pack]`` (:func:`sample_randomness`: numpy's generator, as the pack builder uses it, with the normals its timesteps
take). :func:`sample_uniforms` evaluates the same stream's uniforms for many elements of many samples at once, in
numpy arrays (the balanced deal needs a global batch's, on every rank, cheaply); :func:`cfg_dropped` is the one
decision both feed: an element with ``enable_cfg`` is dropped when its uniform falls below its kind's probability.
"""

from __future__ import annotations

import threading

import numpy as np

from mmidx import format as fmt
from mmidx.config import DropoutConfig

_PHILOX = threading.local()  # each thread's generator for sample_randomness
_WORD, _KEY, _COUNTER = 2**64 - 1, 2**128 - 1, 2**63 - 1  # packs and positions: int64, as sample_uniforms reads them
# Philox4x64-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC11; numpy's bit generator):
# the round's multipliers and the key's Weyl increments.
_MULTIPLIERS = (0xD2E7470EE14C6C93, 0xCA5A826395121157)
_WEYL = (0x9E3779B97F4A7C15, 0xBB67AE8584CAA73B)
_ROUNDS = 10
_LOW = np.uint64(0xFFFFFFFF)


def sample_randomness(seed: int, pack_index: int, position: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Uniform and normal draws for the ``count`` elements of the sample at ``position`` of pack ``pack_index``.

    Philox is counter-based: the stream is a pure function of (seed, pack, position), independent
    of which process asks, in which order, and of every other sample.
    """
    if not 0 <= seed <= _KEY:
        np.random.Philox(key=seed)  # refuses a key out of range in numpy's words
    if not (0 <= position <= _COUNTER and 0 <= pack_index <= _COUNTER):  # -1 would alias 2**64 - 1, 2**63 wrap to 0
        raise ValueError(f"pack {pack_index} and sample position {position} are in [0, 2**63): a pack's randomness "
                         "is keyed by its non-negative index and position, as sample_uniforms takes them")
    generator = getattr(_PHILOX, "generator", None)
    if generator is None:
        generator = _PHILOX.generator = np.random.Generator(np.random.Philox(key=0))
    # The state ``Philox(key=seed, counter=...)`` starts in (key: 128 bits, low word first; buffer empty), set on
    # this thread's generator: a third of the cost of constructing one (which also reads OS entropy), same draws.
    generator.bit_generator.state = {
        "bit_generator": "Philox", "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0,
        "state": {"counter": np.array([0, 0, position, pack_index], np.uint64),
                  "key": np.array([seed & _WORD, seed >> 64], np.uint64)}}
    return generator.random(count), generator.standard_normal(count)


def _multiply(multiplier: int, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The high and low 64-bit words of ``multiplier × value`` (128-bit products, from 32-bit halves)."""
    high_m, low_m = np.uint64(multiplier >> 32), np.uint64(multiplier & 0xFFFFFFFF)
    high_v, low_v = value >> np.uint64(32), value & _LOW
    low_low, low_high, high_low = low_v * low_m, low_v * high_m, high_v * low_m
    carry = ((low_low >> np.uint64(32)) + (low_high & _LOW) + (high_low & _LOW)) >> np.uint64(32)
    high = high_v * high_m + (low_high >> np.uint64(32)) + (high_low >> np.uint64(32)) + carry
    return high, value * np.uint64(multiplier)


def sample_uniforms(seed: int, packs: np.ndarray, positions: np.ndarray, elements: np.ndarray) -> np.ndarray:
    """The uniform :func:`sample_randomness` draws for element ``elements[i]`` of the sample at ``positions[i]`` of
    pack ``packs[i]``, for every i at once: the same Philox stream, evaluated block by block in numpy (element e is
    word ``e % 4`` of the block at counter ``[e // 4 + 1, 0, position, pack]``; a double is its top 53 bits)."""
    packs, positions, elements = (np.asarray(a, dtype=np.int64) for a in (packs, positions, elements))
    if not 0 <= seed <= _KEY or (packs.size and min(packs.min(), positions.min(), elements.min()) < 0):
        np.random.Philox(key=seed)  # refuses a key out of range, as sample_randomness does
        raise ValueError("packs, sample positions and elements are non-negative")
    words = [elements // 4 + 1, np.zeros_like(elements), positions, packs]  # the counter, low word first
    counter = [np.asarray(word, dtype=np.uint64) for word in words]
    key = [seed & _WORD, seed >> 64]
    with np.errstate(over="ignore"):
        for round_ in range(_ROUNDS):
            if round_:
                key = [(key[0] + _WEYL[0]) & _WORD, (key[1] + _WEYL[1]) & _WORD]
            high0, low0 = _multiply(_MULTIPLIERS[0], counter[0])
            high1, low1 = _multiply(_MULTIPLIERS[1], counter[2])
            counter = [high1 ^ counter[1] ^ np.uint64(key[0]), low1, high0 ^ counter[3] ^ np.uint64(key[1]), low0]
    block = np.stack(counter)
    word = block[elements % 4, np.arange(len(elements))]
    return (word >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def cfg_dropped(kinds: np.ndarray, flags: np.ndarray, uniforms: np.ndarray, dropout: DropoutConfig) -> np.ndarray:
    """Which elements CFG dropout removes: those with ``enable_cfg`` whose uniform is below their kind's
    probability (``dropout.text``, ``.vit`` or ``.vae``). ``kinds``, ``flags``: the plan records' fields;
    ``uniforms``: each element's draw (:func:`sample_randomness`, :func:`sample_uniforms`)."""
    probability = np.zeros(len(fmt.KIND_NAMES))
    probability[[fmt.TEXT, fmt.VIT_IMAGE, fmt.VAE_IMAGE]] = dropout.text, dropout.vit, dropout.vae
    enabled = (np.asarray(flags) & fmt.FLAG_ENABLE_CFG) != 0
    return enabled & (np.asarray(uniforms) < probability[np.asarray(kinds, dtype=np.intp)])
