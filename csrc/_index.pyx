"""Kernels behind Megatron's GPT indices: numpy's legacy shuffle and ``build_sample_idx``.

``legacy_shuffle`` is ``numpy.random.RandomState.shuffle`` for a contiguous 1-D array, drawing
from the RandomState's own bit generator, so it yields the same permutation and leaves the
generator in the same state. numpy spends its time in a generic per-element ``memcpy`` and in
cache misses on ``x[j]``; here the swaps are typed and, because the swap targets ``j`` do not
depend on the data, a block of them is drawn first and their cache lines prefetched.

``build_sample_index`` is helpers.cpp's ``build_sample_idx`` loop, typed for 32- and 64-bit
sizes, document indices and outputs, run without the GIL, with ``sizes[document_index[k]]``
prefetched a few documents ahead (the shuffled document order makes those loads random).
"""

from cpython.pycapsule cimport PyCapsule_GetPointer
from libc.math cimport ceilf
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from numpy.random cimport bitgen_t


cdef extern from *:
    void __builtin_prefetch(const void* address, int rw, int locality) nogil


cdef enum:
    # Swap targets drawn (and prefetched) ahead of the swaps: enough to cover memory latency,
    # few enough that the prefetched lines are still in L1 when the swaps reach them.
    SHUFFLE_BLOCK = 64
    # Documents looked ahead when prefetching ``sizes[document_index[k]]``.
    SIZES_LOOKAHEAD = 16


ctypedef fused word_t:
    uint8_t
    uint16_t
    uint32_t
    uint64_t

ctypedef fused sizes_t:
    int32_t
    int64_t

ctypedef fused document_t:
    int32_t
    int64_t

ctypedef fused sample_t:
    int32_t
    int64_t


cdef inline uint64_t _smallest_mask(uint64_t value) noexcept nogil:
    """The smallest all-ones bit pattern >= ``value``."""
    value |= value >> 1
    value |= value >> 2
    value |= value >> 4
    value |= value >> 8
    value |= value >> 16
    value |= value >> 32
    return value


cdef inline uint64_t _random_interval(bitgen_t* bitgen, uint64_t maximum, uint64_t mask) noexcept nogil:
    """numpy's ``random_interval``: masked rejection sampling of a value in [0, maximum].

    32-bit draws while ``maximum`` fits in 32 bits, 64-bit draws beyond: exactly the draws numpy
    makes, so the generator ends in the same state.
    """
    cdef uint64_t value
    if maximum == 0:
        return 0
    if maximum <= 0xFFFFFFFFU:
        value = bitgen.next_uint32(bitgen.state) & mask
        while value > maximum:
            value = bitgen.next_uint32(bitgen.state) & mask
    else:
        value = bitgen.next_uint64(bitgen.state) & mask
        while value > maximum:
            value = bitgen.next_uint64(bitgen.state) & mask
    return value


cdef inline bitgen_t* _bitgen_of(object random_state) except NULL:
    return <bitgen_t*> PyCapsule_GetPointer(random_state._bit_generator.capsule, "BitGenerator")


cdef void _fisher_yates(bitgen_t* bitgen, word_t* x, int64_t n) noexcept nogil:
    cdef uint64_t targets[SHUFFLE_BLOCK]
    cdef uint64_t i = n - 1 if n > 0 else 0
    cdef uint64_t mask = _smallest_mask(i)
    cdef uint64_t j, top
    cdef int64_t k, count
    cdef word_t held
    while i > 0:
        count = SHUFFLE_BLOCK if i >= SHUFFLE_BLOCK else i
        top = i
        for k in range(count):
            while (mask >> 1) >= i:
                mask >>= 1
            j = _random_interval(bitgen, i, mask)
            targets[k] = j
            __builtin_prefetch(&x[j], 1, 3)
            i -= 1
        for k in range(count):
            j = targets[k]
            held = x[top - k]
            x[top - k] = x[j]
            x[j] = held


def legacy_shuffle(object random_state, word_t[::1] x):
    """Shuffle ``x`` in place exactly as ``random_state.shuffle(x)`` would (see module doc)."""
    cdef bitgen_t* bitgen = _bitgen_of(random_state)
    cdef int64_t n = x.shape[0]
    if n < 2:
        return
    with random_state._bit_generator.lock:
        with nogil:
            _fisher_yates(bitgen, &x[0], n)


def random_interval(object random_state, uint64_t maximum):
    """One legacy bounded draw in [0, maximum]; lets tests check the 64-bit branch directly."""
    cdef bitgen_t* bitgen = _bitgen_of(random_state)
    with random_state._bit_generator.lock:
        return _random_interval(bitgen, maximum, _smallest_mask(maximum))


def sample_count(int64_t num_epochs, int64_t tokens_per_epoch, int64_t sequence_length,
                 bint drop_last_partial_sequence, int64_t add_extra_token):
    """Number of samples helpers.cpp builds, including its single-precision ``ceil`` for
    ``drop_last_partial_sequence=False`` (``float`` is IEEE binary32 here, as in the C++)."""
    cdef int64_t tokens = num_epochs * tokens_per_epoch - add_extra_token
    cdef float quotient
    if drop_last_partial_sequence:
        return tokens // sequence_length
    quotient = (<float> tokens) / (<float> sequence_length)
    return <int64_t> ceilf(quotient)


cdef int64_t _sample_index(const sizes_t[::1] sizes, const document_t[::1] document_index,
                           int64_t sequence_length, int64_t add_extra_token,
                           sample_t[:, ::1] out) noexcept nogil:
    cdef int64_t num_rows = out.shape[0]
    cdef int64_t num_documents = document_index.shape[0]
    cdef int64_t num_sizes = sizes.shape[0]
    cdef int64_t row, position = 0, offset = 0, remaining, length, document, ahead
    for ahead in range(min(<int64_t> SIZES_LOOKAHEAD, num_documents)):
        document = document_index[ahead]
        if document < 0 or document >= num_sizes:
            return ahead
        __builtin_prefetch(&sizes[document], 0, 3)
    out[0, 0] = 0
    out[0, 1] = 0
    for row in range(1, num_rows):
        remaining = sequence_length + add_extra_token
        while remaining != 0:
            length = sizes[document_index[position]] - offset
            remaining -= length
            if remaining <= 0:
                offset += remaining + length - add_extra_token
                remaining = 0
            elif position == num_documents - 1:
                offset = sizes[document_index[position]] - add_extra_token
                break
            else:
                position += 1
                offset = 0
                ahead = position + SIZES_LOOKAHEAD - 1
                if ahead < num_documents:
                    document = document_index[ahead]
                    if document < 0 or document >= num_sizes:
                        return ahead
                    __builtin_prefetch(&sizes[document], 0, 3)
        out[row, 0] = <sample_t> position
        out[row, 1] = <sample_t> offset
    return -1


def build_sample_index(const sizes_t[::1] sizes, const document_t[::1] document_index,
                       int64_t sequence_length, int64_t add_extra_token, sample_t[:, ::1] out):
    """Fill ``out`` (num_samples + 1 rows of (document_index position, offset)) like helpers.cpp.

    Each sample spans ``sequence_length + add_extra_token`` tokens and the next one starts
    ``sequence_length`` tokens later. When the documents run out before ``out`` is full (only
    possible through the rounding of ``sample_count`` without drop_last), the remaining rows
    repeat (last position, size of last document - add_extra_token), as helpers.cpp writes them.
    Returns -1, or the position in ``document_index`` of a document id outside ``sizes``.
    """
    cdef int64_t bad
    if document_index.shape[0] == 0:
        raise ValueError("the document index is empty; there are no tokens to build samples from")
    if out.shape[0] == 0:
        return -1
    with nogil:
        bad = _sample_index(sizes, document_index, sequence_length, add_extra_token, out)
    return bad
