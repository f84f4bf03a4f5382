"""A sample's dense attention mask written row by row as runs of two values, with streaming stores.

Every row of BAGEL's per-sample mask is a few runs of constant value (``mmidx.pack.masks``' rule): a row q of
split j attends to every earlier split that is not noise, to its own split up to its limit (q + 1 for a causal
split, the split's end otherwise), and to nothing after. So a row is: for each earlier split, a run of
"attend" (or "blocked" where that split is noise); a run of "attend" from the split's start to the limit; a run
of "blocked" to the end of the row. Nothing is read: the mask is stored once, as a memset would store it.

The runs are written with streaming (non-temporal) stores: a pack's masks are far larger than the caches and
are not read while they are built, and ordinary stores (glibc's memset among them) first read every destination
line (a read-for-ownership): two passes of memory traffic over the mask where these make one, which made
``benchmarks/bench_masks.py``'s masks about twice as fast as a memset of their bytes. Values are given as the
bit patterns of one element (1, 2, 4 or 8 bytes: a floating dtype's 0 and -inf), so float32, bfloat16 and the
rest are one code.
"""

from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t
from libc.string cimport memcpy

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #endif
    /* Store n bytes of the 8-byte pattern at dst: byte at address a gets pattern byte (a & 7), so a pattern
       rotated to the buffer's alignment repeats its elements from any element-aligned dst. Whole 64-byte lines
       are written with streaming stores, the partial lines at a run's ends with ordinary ones: a line only
       partly written by streaming stores is flushed as a partial write, which costs more than it saves (16%
       of a pack's masks, measured against streaming from 16-byte alignment). */
    static void mmidx_mask_run(uint8_t *dst, size_t n, uint64_t pattern) {
        const uint8_t *bytes = (const uint8_t *)&pattern;
        for (; n && ((uintptr_t)dst & 7); n--, dst++) *dst = bytes[(uintptr_t)dst & 7];
    #if defined(__SSE2__)
        if (n >= 128) {  /* at least one whole line after the alignment */
            __m128i value = _mm_set1_epi64x((long long)pattern);
            for (; (uintptr_t)dst & 63; n -= 8, dst += 8) memcpy(dst, &pattern, 8);
            for (; n >= 64; n -= 64, dst += 64) {
                _mm_stream_si128((__m128i *)dst, value);
                _mm_stream_si128((__m128i *)(dst + 16), value);
                _mm_stream_si128((__m128i *)(dst + 32), value);
                _mm_stream_si128((__m128i *)(dst + 48), value);
            }
        }
    #endif
        for (; n >= 8; n -= 8, dst += 8) memcpy(dst, &pattern, 8);
        for (; n; n--, dst++) *dst = bytes[(uintptr_t)dst & 7];
    }
    static void mmidx_mask_fence(void) {
    #if defined(__SSE2__)
        _mm_sfence();
    #endif
    }
    """
    void mmidx_mask_run(uint8_t* dst, size_t n, uint64_t pattern) noexcept nogil
    void mmidx_mask_fence() noexcept nogil


cdef uint64_t _rotated(uint64_t pattern, uintptr_t base) noexcept nogil:
    """``pattern`` (element bytes repeated, in memory order) as seen from addresses whose byte 0 is ``base``:
    byte ``(base + k) & 7`` of the result is byte ``k`` of ``pattern``, on a machine of either byte order."""
    cdef uint8_t source[8]
    cdef uint8_t rotated[8]
    cdef int k
    memcpy(source, &pattern, 8)
    for k in range(8):
        rotated[(base + k) & 7] = source[k]
    memcpy(&pattern, rotated, 8)
    return pattern


cdef inline void _run(uint8_t* row, int64_t first, int64_t stop, uint64_t value, int itemsize) noexcept nogil:
    """Columns [first, stop) of ``row`` set to ``value``."""
    mmidx_mask_run(row + first * itemsize, (stop - first) * itemsize, value)


def fill_sample_mask(uint8_t[::1] out, const int64_t[::1] ends, const uint8_t[::1] causal,
                     const uint8_t[::1] noise, uint64_t attend, uint64_t blocked, int itemsize):
    """Write one sample's (L, L) mask into ``out`` (L * L * ``itemsize`` bytes, row-major).

    The sample's non-empty splits end at ``ends`` (increasing, the last at L, the first split starting at 0) with
    ``causal``/``noise`` flags (0 or 1) per split; ``attend``/``blocked`` are one element's bytes repeated over
    8 bytes, as the integer those bytes make in the machine's byte order. ValueError (nothing written) when the sizes, the flags or the splits are inconsistent."""
    cdef Py_ssize_t splits = ends.shape[0], j, m
    cdef int64_t length = ends[splits - 1] if splits else 0, q, start, split_start, limit, run_start
    cdef uint8_t* row
    cdef uint8_t run_noise
    cdef uint64_t values[2]
    if itemsize not in (1, 2, 4, 8):
        raise ValueError(f"fill_sample_mask: itemsize must be 1, 2, 4 or 8, got {itemsize}")
    if causal.shape[0] != splits or noise.shape[0] != splits:
        raise ValueError("fill_sample_mask: ends, causal and noise differ in length")
    for j in range(splits):
        if ends[j] <= (ends[j - 1] if j else 0) or causal[j] > 1 or noise[j] > 1:
            raise ValueError(f"fill_sample_mask: split {j} is empty, ends before the previous one or has a flag "
                             "other than 0 or 1")
    if out.shape[0] != length * length * itemsize:
        raise ValueError(f"fill_sample_mask: out holds {out.shape[0]} bytes, not the {length * length * itemsize} "
                         f"of a {length}-token mask")
    if length == 0:
        return
    values[0] = _rotated(attend, <uintptr_t>&out[0])
    values[1] = _rotated(blocked, <uintptr_t>&out[0])
    with nogil:
        for j in range(splits):
            start = ends[j - 1] if j else 0
            for q in range(start, ends[j]):
                row = &out[0] + q * length * itemsize
                run_start, run_noise = 0, 0
                for m in range(j):  # the earlier splits: attend, or blocked over noise splits, in runs
                    if noise[m] != run_noise:
                        split_start = ends[m - 1] if m else 0
                        _run(row, run_start, split_start, values[run_noise], itemsize)
                        run_start, run_noise = split_start, noise[m]
                if run_noise:
                    _run(row, run_start, start, values[1], itemsize)
                    run_start = start
                limit = q + 1 if causal[j] else ends[j]  # its own split, up to the row's limit
                _run(row, run_start, limit, values[0], itemsize)
                _run(row, limit, length, values[1], itemsize)  # nothing after it
        mmidx_mask_fence()
