"""Kernel of mmidx's multimodal stream: which sample of its group each stream item is.

The j-th item taken from group g (of n_g samples) is sample ``P(g, e)[j % n_g]`` of epoch
``e = j // n_g``, where ``P(g, e)`` is a keyed pseudo-random permutation of [0, n_g): a Feistel
network over the smallest power of two >= n_g (halves of floor(bits/2) and ceil(bits/2) bits,
``ROUNDS`` rounds of a splitmix64 round function), cycle-walked back into [0, n_g). So:

- every epoch visits each sample of the group exactly once (a bijection, whatever n_g is);
- a sample's place is computed in O(1) time and memory from (key, epoch, position): nothing of
  size n_g is ever materialised, so groups of billions of samples cost nothing extra, and a
  longer stream extends a shorter one;
- a partial last epoch is a pseudo-random subset, shuffled apart from the earlier epochs.

Cycle walking takes fewer than two rounds of the network on average (the domain is < 2 n_g).
"""

from libc.stdint cimport int16_t, int32_t, int64_t, uint64_t
from libc.stdlib cimport free, malloc


cdef extern from *:
    void __builtin_prefetch(const void* address, int rw, int locality) nogil


cdef enum:
    ROUNDS = 6
    # Items looked ahead when prefetching their rows of the view tables.
    LOOKAHEAD = 16


ctypedef fused group_t:
    int16_t
    int32_t


ctypedef fused count_t:  # a view table's token counts: int32 (what the pack index builds), or int64
    int32_t
    int64_t


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    """splitmix64: a bijective 64-bit mixer with full avalanche."""
    x += 0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline int _bits_for(uint64_t n) noexcept nogil:
    """Bits of the smallest power of two >= n (at least 1)."""
    cdef int bits = 1
    while bits < 64 and (1ULL << bits) < n:
        bits += 1
    return bits


cdef inline void _epoch_keys(uint64_t group_key, int64_t epoch, uint64_t* keys) noexcept nogil:
    cdef uint64_t base = _mix(group_key ^ _mix(<uint64_t> epoch))
    cdef int r
    for r in range(ROUNDS):
        keys[r] = _mix(base + <uint64_t> r * 0xD1B54A32D192ED03ULL)


cdef inline uint64_t _permute(const uint64_t* keys, uint64_t n, int bits, uint64_t x) noexcept nogil:
    """Position x of the keyed permutation of [0, n)."""
    cdef int low_bits = bits - bits // 2
    cdef uint64_t high_mask = (1ULL << (bits // 2)) - 1
    cdef uint64_t low_mask = (1ULL << low_bits) - 1
    cdef uint64_t high, low
    cdef int r
    while True:
        high = x >> low_bits
        low = x & low_mask
        for r in range(ROUNDS):
            # Each round XORs one half with a function of the other: a bijection for any sizes.
            if r % 2 == 0:
                high ^= _mix(low ^ keys[r]) & high_mask
            else:
                low ^= _mix(high ^ keys[r]) & low_mask
        x = (high << low_bits) | low
        if x < n:
            return x


def stream_samples(const group_t[::1] group_ids not None, const int64_t[::1] taken not None,
                   const int64_t[::1] group_sizes not None, const uint64_t[::1] group_keys not None,
                   int64_t[::1] sample_ids not None, int64_t[::1] epochs not None):
    """Fill ``sample_ids`` and ``epochs`` of every item, the ``taken[i]``-th of its group."""
    cdef int64_t num_groups = group_sizes.shape[0]
    cdef int64_t i, group, size, epoch, within
    cdef uint64_t* keys = <uint64_t*> malloc(max(num_groups, 1) * ROUNDS * sizeof(uint64_t))
    cdef int64_t* keyed_epoch = <int64_t*> malloc(max(num_groups, 1) * sizeof(int64_t))
    cdef int64_t* epoch_start = <int64_t*> malloc(max(num_groups, 1) * sizeof(int64_t))
    cdef int* bits = <int*> malloc(max(num_groups, 1) * sizeof(int))
    if keys == NULL or keyed_epoch == NULL or epoch_start == NULL or bits == NULL:
        free(keys)
        free(keyed_epoch)
        free(epoch_start)
        free(bits)
        raise MemoryError()
    with nogil:
        for group in range(num_groups):
            keyed_epoch[group] = -1
            epoch_start[group] = -group_sizes[group]
            bits[group] = _bits_for(<uint64_t> group_sizes[group])
        for i in range(group_ids.shape[0]):
            group = group_ids[i]
            size = group_sizes[group]
            within = taken[i] - epoch_start[group]
            if within < 0 or within >= size:  # items of a group reach a new epoch in order: divide rarely
                epoch = taken[i] // size
                _epoch_keys(group_keys[group], epoch, &keys[group * ROUNDS])
                keyed_epoch[group] = epoch
                epoch_start[group] = epoch * size
                within = taken[i] - epoch_start[group]
            epochs[i] = keyed_epoch[group]
            sample_ids[i] = <int64_t> _permute(&keys[group * ROUNDS], <uint64_t> size, bits[group], <uint64_t> within)
    free(keys)
    free(keyed_epoch)
    free(epoch_start)
    free(bits)


def item_views(const int32_t[::1] group_ids not None, const int64_t[::1] sample_ids not None,
               const int64_t[::1] epochs not None, const int64_t[::1] group_base not None,
               const int64_t[::1] view_offsets not None, const count_t[::1] view_tokens not None, int64_t key_stride,
               int32_t[::1] views not None, int64_t[::1] counts not None, int64_t[::1] keys not None):
    """View ``epoch mod K`` of every item's sample and its token count; ``keys`` (when not empty)
    gets ``(group_base[group] + sample) * key_stride + view``. Samples are numbered across all
    groups from ``group_base``; the views of sample s are ``view_offsets[s]:view_offsets[s + 1]``, or, with
    ``view_offsets`` empty, view s alone (every sample has one view). The caller checks every id against the
    tables.

    The two table reads of an item are random over tables larger than the caches, so they run
    as passes over the chunk, each prefetching ``LOOKAHEAD`` items ahead.
    """
    cdef int64_t n = group_ids.shape[0], i, sample, first, view
    cdef bint keyed = keys.shape[0] > 0
    cdef bint one_view = view_offsets.shape[0] == 0
    cdef int64_t* numbers = <int64_t*> malloc(max(n, 1) * sizeof(int64_t))
    if numbers == NULL:
        raise MemoryError()
    with nogil:
        for i in range(n):
            numbers[i] = group_base[group_ids[i]] + sample_ids[i]
        if one_view:
            for i in range(n):
                views[i] = 0
                counts[i] = numbers[i]
                if keyed:
                    keys[i] = numbers[i] * key_stride
        else:
            for i in range(n):
                if i + LOOKAHEAD < n:
                    __builtin_prefetch(&view_offsets[numbers[i + LOOKAHEAD]], 0, 0)
                sample = numbers[i]
                first = view_offsets[sample]
                view = epochs[i] % (view_offsets[sample + 1] - first)
                views[i] = <int32_t> view
                counts[i] = first + view  # the view's place in view_tokens, read in the next pass
                if keyed:
                    keys[i] = sample * key_stride + view
        for i in range(n):
            if i + LOOKAHEAD < n:
                __builtin_prefetch(&view_tokens[counts[i + LOOKAHEAD]], 0, 0)
            counts[i] = view_tokens[counts[i]]
    free(numbers)
