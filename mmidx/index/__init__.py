"""Sample indices: Megatron's GPT indices and blends, bit for bit and faster; multimodal packing.

Every function here is a pure function of its arguments (a ``RandomState`` argument counts as one:
it is consumed exactly as Megatron consumes it). The Cython kernels live in ``csrc/``.

Megatron GPT indices — ``gpt_indices`` and its parts ``build_document_index``,
``build_sample_index``, ``build_shuffle_index``.
    Guarantee: for the same sequence lengths, exposed documents, sequence length, requested number
    of samples, seed, ``add_extra_token`` and ``drop_last``, each array and its dtype equal what
    megatron-core 0.16's ``GPTDataset._build_document_sample_shuffle_indices`` builds: the number of
    epochs, the separate final epoch (when it would hold fewer than ``int(0.80 * samples per
    epoch)`` samples), the document index shuffled by ``RandomState(seed)`` in Megatron's order,
    helpers.cpp's sample index (including its single-precision ``ceil`` without drop_last and its
    end-of-documents rows) and the shuffle index. Beyond Megatron's limits the same rules carry on
    in 64 bits where Megatron would wrap around: int64 sequence lengths, document ids >= 2**31.
    Speed: numpy's ``RandomState.shuffle`` is redone as a typed Fisher-Yates on the same bit
    generator (same permutation, same generator state after) that draws its swap targets ahead and
    prefetches them, and the sample-index loop runs without the GIL, prefetching document sizes.

Blending — ``blending_indices``, ``exhaustive_blending_indices``.
    Guarantee: equal to helpers.cpp's ``build_blending_indices`` / ``build_exhaustive_blending_indices``
    as ``BlendedDataset`` calls them (weights normalised by ``w / sum(w)`` in float64): sample s
    goes to the dataset with the largest ``weight * max(s, 1) - taken``, ties to the lowest index.
    Sample counters are int64; the dataset index is int16 up to 32,767 datasets (as Megatron's) and
    int32 beyond, where Megatron stops.

Multimodal stream — ``multimodal_stream``, ``stream_views``.
    Guarantee: the group order is the greedy blend above; the j-th item taken from group g is
    sample ``P(g, e)[j % n_g]`` of epoch ``e = j // n_g``, where ``P(g, e)`` is a keyed
    pseudo-random permutation of the group's n_g samples (a cycle-walked Feistel network keyed by
    ``SeedSequence([seed, g])`` and e; ``csrc/_stream.pyx``). Each epoch visits every sample once, a
    partial last epoch is a pseudo-random subset shuffled apart, a longer stream extends a shorter
    one, and no array of size n_g is ever built: O(1) memory per group, whatever its size (a
    ``numpy`` permutation per epoch would need n_g int64s for every epoch touched). Token counts
    follow DESIGN's views: epoch e of a sample with K views uses view ``e mod K``, so every count is
    exact before any data is read.

Packing — ``pack_samples``.
    Guarantee: every item is either in exactly one pack or in ``excluded`` (over the per-sample
    limit); no pack holds more than ``max_num_tokens``; packs are a pure function of the inputs
    (no RNG); each pack starts with one item of every mandatory group, in group order (except solo
    packs, exhausted groups, or a mandatory item that does not fit beside the earlier ones); the
    deferral buffer never holds more than ``max_buffer_size + 1`` items. O(n log B) time. The rules
    are spelled out in ``pack_samples``.

Streamed packing — ``PackStream``.
    Guarantee: the packs of ``multimodal_stream`` → ``stream_views`` → ``pack_samples``, item for
    item (as sample numbers and views), computed a chunk at a time: the blend's counts, the
    packer's buffer, open pack and mandatory queues carry over chunk boundaries, so memory is the
    chunk and the view tables, whatever the stream's length.

Mixture schedules — ``Phase``, ``PhasedBlend`` (:mod:`mmidx.index.schedule`), ``MixtureHistory``
(:mod:`mmidx.index.history`), ``mixture_report`` (:mod:`mmidx.index.mixture`).
    Guarantee: a phase blends its groups greedily with its own error term (each group's share over the
    phase within one item of its weight) while every group's count of items carries over phase
    boundaries, so the j-th item of a group is the same whatever the phases: within an epoch of a group
    no sample repeats or is skipped. A phase ends at the stream item whose packing reached its limit,
    whatever the chunk size; one phase of positive weights is the plain blend, call for call. A history
    of configs and the packs where each took over is one schedule whose packs before each change point
    are those of the run without the change.
"""
