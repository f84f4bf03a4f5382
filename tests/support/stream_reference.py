"""A plain-Python reference of the multimodal stream's documented rules, written from the docstrings of
``mmidx.index.stream``, ``mmidx.index.schedule``, ``mmidx.index.blend`` and ``csrc/_stream.pyx``, and from
numpy's published SeedSequence algorithm, sharing no code with mmidx (nothing here imports it): Python integers
and floats, one item at a time. Tests compare mmidx's stream with it, and pin golden values it computed.

- A group's permutation key is ``SeedSequence([seed, group]).generate_state(1, np.uint64)[0]``
  (:func:`seed_sequence_word`, O'Neill's seed_seq hash as numpy's ``bit_generator.pyx`` implements it).
- Epoch e of group g is a Feistel network over the smallest power of two >= n_g (high half floor(bits / 2)
  bits, low half the rest), 6 rounds of splitmix64 keyed from the group key and e, cycle-walked into [0, n_g);
  the j-th item of group g is sample ``P(g, j // n_g)[j % n_g]`` (:func:`group_sample`).
- The blend gives item s of a phase to the group of largest ``weight * max(s, 1) - taken in the phase``, ties to
  the lowest group, weights ``w / sum(w)`` over the phase's groups of positive weight (:func:`phased_groups`).
"""

M32, M64 = 2**32 - 1, 2**64 - 1
ROUNDS = 6


def seed_sequence_word(entropy: list[int]) -> int:
    """``numpy.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]`` for entropy words in [0, 2**32)
    (pool of 4 words, no spawn key)."""
    assert all(0 <= word <= M32 for word in entropy)
    hash_const = 0x43B0D7E5

    def hashmix(value: int) -> int:
        nonlocal hash_const
        value ^= hash_const
        hash_const = (hash_const * 0x931E8875) & M32
        value = (value * hash_const) & M32
        return value ^ (value >> 16)

    def mix(x: int, y: int) -> int:
        result = (0xCA01F9DD * x - 0x4973F715 * y) & M32
        return result ^ (result >> 16)

    pool = [hashmix(entropy[i] if i < len(entropy) else 0) for i in range(4)]
    for source in range(4):
        for target in range(4):
            if source != target:
                pool[target] = mix(pool[target], hashmix(pool[source]))
    for source in range(4, len(entropy)):
        for target in range(4):
            pool[target] = mix(pool[target], hashmix(entropy[source]))
    const, words = 0x8B51F9DD, []
    for word in pool[:2]:  # two 32-bit words, low first, make the uint64
        word ^= const
        const = (const * 0x58F38DED) & M32
        word = (word * const) & M32
        words.append(word ^ (word >> 16))
    return words[0] | words[1] << 32


def group_key(seed: int, group: int) -> int:
    """Group ``group``'s permutation key."""
    return seed_sequence_word([seed, group])


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def epoch_round_keys(key: int, epoch: int) -> list[int]:
    base = splitmix64(key ^ splitmix64(epoch))
    return [splitmix64((base + r * 0xD1B54A32D192ED03) & M64) for r in range(ROUNDS)]


def permuted(round_keys: list[int], n: int, x: int) -> int:
    """Place ``x`` of the keyed permutation of [0, n)."""
    bits = max(1, (n - 1).bit_length())
    high_bits = bits // 2
    low_bits = bits - high_bits
    while True:
        high, low = x >> low_bits, x & ((1 << low_bits) - 1)
        for r, round_key in enumerate(round_keys):
            if r % 2 == 0:
                high ^= splitmix64(low ^ round_key) & ((1 << high_bits) - 1)
            else:
                low ^= splitmix64(high ^ round_key) & ((1 << low_bits) - 1)
        x = (high << low_bits) | low
        if x < n:
            return x


def group_sample(seed: int, group: int, size: int, j: int) -> tuple[int, int]:
    """(sample, epoch) of the j-th item of a group of ``size`` samples."""
    epoch, within = divmod(j, size)
    return permuted(epoch_round_keys(group_key(seed, group), epoch), size, within), epoch


def phased_groups(phases: list[tuple[list[float], int]]) -> list[int]:
    """The group of each item of consecutive phases, each ``(weights, items in the phase)``."""
    groups = []
    for weights, length in phases:
        active = [g for g, w in enumerate(weights) if w > 0]
        total = sum(weights[g] for g in active)
        normalised = [weights[g] / total for g in active]
        taken = [0] * len(active)
        for s in range(length):
            errors = [w * max(s, 1) - t for w, t in zip(normalised, taken, strict=True)]
            best = errors.index(max(errors))  # the first of equal errors: the lowest group
            taken[best] += 1
            groups.append(active[best])
    return groups


def stream(sizes: list[int], phases: list[tuple[list[float], int]], seed: int) -> list[tuple[int, int, int]]:
    """(group, sample, epoch) of every item of a phased stream over groups of ``sizes`` samples."""
    taken = [0] * len(sizes)
    items = []
    for group in phased_groups(phases):
        items.append((group, *group_sample(seed, group, sizes[group], taken[group])))
        taken[group] += 1
    return items
