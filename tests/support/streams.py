"""Pack-stream test data: the whole-array reference of PackStream, random packing problems, and the
deterministic token-count mixes (scale, text, video) of the packing tests."""

import numpy as np
from hypothesis import strategies as st

from mmidx.index.pack_stream import PackStream
from mmidx.index.packer import pack_samples
from mmidx.index.stream import ViewTable, multimodal_stream, stream_views


def whole_array(offsets, tokens, weights, mandatory, num_samples, seed, budgets):
    """(pack_offsets, samples numbered across groups, views, stats) of the in-memory reference."""
    groups, samples, epochs = multimodal_stream([len(o) - 1 for o in offsets], weights, num_samples, seed)
    views, counts = stream_views(groups, samples, epochs, offsets, tokens)
    packed = pack_samples(counts, groups, mandatory=mandatory, **budgets)
    base = np.concatenate(([0], np.cumsum([len(o) - 1 for o in offsets])))
    numbers = base[groups] + samples
    return packed.pack_offsets, numbers[packed.pack_items], views[packed.pack_items], packed.stats


def streamed(offsets, tokens, weights, mandatory, num_samples, seed, budgets, chunk_size):
    stream = PackStream(ViewTable.of(offsets, tokens), weights, num_samples, seed, mandatory=mandatory,
                        chunk_size=chunk_size, **budgets)
    chunks = list(stream)
    sizes = np.cumsum([0] + [len(c.samples) for c in chunks[:-1]])
    pack_offsets = np.concatenate([[0]] + [c.pack_ends + base for c, base in zip(chunks, sizes, strict=True)])
    samples = np.concatenate([c.samples for c in chunks])
    views = np.concatenate([c.views for c in chunks])
    assert sum(stream.group_counts) == num_samples
    return pack_offsets, samples, views, stream.stats


@st.composite
def problems(draw):
    num_groups = draw(st.integers(1, 3))
    offsets, tokens = [], []
    for _ in range(num_groups):
        views = draw(st.lists(st.integers(1, 3), min_size=1, max_size=12))
        offsets.append(np.concatenate([[0], np.cumsum(views)]))
        tokens.append(np.array(draw(st.lists(st.integers(0, 45), min_size=sum(views), max_size=sum(views)))))
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=num_groups, max_size=num_groups))
    mandatory = draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
    max_num_tokens = draw(st.integers(10, 60))
    budgets = {
        "max_num_tokens": max_num_tokens,
        "expected_num_tokens": draw(st.integers(1, max_num_tokens)),
        "max_num_tokens_per_sample": draw(st.integers(1, max_num_tokens)),
        "prefer_buffer_before": draw(st.integers(0, max_num_tokens + 5)),
        "max_buffer_size": draw(st.integers(0, 5)),
    }
    return offsets, tokens, weights, mandatory, draw(st.integers(0, 300)), draw(st.integers(0, 3)), budgets


def mix(kind, n, seed=0):
    """(token counts, groups) of a deterministic blend: the scale mix, text-only lognormal, video-heavy."""
    rng = np.random.default_rng(seed)
    means, weights = {"scale": ([1100, 5000, 1500], [0.5, 0.2, 0.3]), "text": ([600, 2000], [0.7, 0.3]),
                      "video": ([12000, 1500, 800], [0.4, 0.3, 0.3])}[kind]
    groups = multimodal_stream([n] * len(means), weights, n, seed)[0]
    counts = np.clip(rng.lognormal(np.log(np.array(means)[groups]), 0.5), 16, 16384).astype(np.int64)
    return counts, groups
