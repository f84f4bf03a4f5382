"""Byte ranges of a mapped file copied into one batch buffer in one call, with streaming stores.

A pack's precached records (ViT encodings, VAE moments) are copied from a stream's mapped ``.bin`` into a batch
buffer that building the pack does not read again. Ordinary stores first read every
destination cache line they write (a read-for-ownership); streaming (non-temporal) stores write whole lines
without reading them: memory traffic of two passes over the bytes instead of three. glibc's ``memcpy`` switches
to them only above a threshold derived from the cache size (``x86_non_temporal_threshold``), which a pack's
records of 0.1 to 3 MB each stay under.

Each record is ``planes`` x ``rows`` rows of ``row_bytes`` contiguous bytes at its source offset, written at its
destination offset + plane * ``plane_stride`` + row * ``row_stride``: one contiguous run for packed layouts, and
the top-left corner of a padded slot for padded ones. Every range is checked against both buffers first.
"""

from libc.stdint cimport int64_t, uint8_t

cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__)
    #include <emmintrin.h>
    #include <xmmintrin.h>
    /* memcpy with 16-byte streaming stores: the destination is aligned by a short memcpy, the source read unaligned. */
    static void mmidx_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        if (n < 256) { memcpy(dst, src, n); return; }
        memcpy(dst, src, head); dst += head; src += head; n -= head;
        for (; n >= 64; n -= 64, src += 64, dst += 64) {
            /* reads 1 KiB ahead stay in flight across the source's page boundaries, where hardware
               prefetchers stop (5-8% off building a 512^2 frozen-ViT edit pack, alternating runs); a prefetch
               past the end of a mapping is a hint and never faults */
            _mm_prefetch((const char *)src + 1024, _MM_HINT_NTA);
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
    }
    static void mmidx_stream_fence(void) { _mm_sfence(); }
    #else
    static void mmidx_stream_copy(uint8_t *dst, const uint8_t *src, size_t n) { memcpy(dst, src, n); }
    static void mmidx_stream_fence(void) {}
    #endif
    """
    void mmidx_stream_copy(uint8_t* dst, const uint8_t* src, size_t n) noexcept nogil
    void mmidx_stream_fence() noexcept nogil


def copy_records(const uint8_t[::1] source, const int64_t[::1] offsets, uint8_t[::1] out,
                 const int64_t[::1] destinations, const int64_t[::1] planes, const int64_t[::1] rows,
                 const int64_t[::1] row_bytes, int64_t plane_stride, int64_t row_stride):
    """Copy record i (``planes[i] * rows[i] * row_bytes[i]`` bytes at ``source[offsets[i]:]``) into ``out`` at
    ``destinations[i]``, row by row at the given strides; ValueError (nothing copied) if any range is outside."""
    cdef Py_ssize_t i, count = offsets.shape[0]
    cdef int64_t p, r, size, last
    if not (destinations.shape[0] == planes.shape[0] == rows.shape[0] == row_bytes.shape[0] == count):
        raise ValueError("copy_records: offsets, destinations, planes, rows and row_bytes differ in length")
    for i in range(count):
        if offsets[i] < 0 or destinations[i] < 0 or planes[i] < 0 or rows[i] < 0 or row_bytes[i] < 0:
            raise ValueError(f"copy_records: record {i} has a negative offset or size")
        size = planes[i] * rows[i] * row_bytes[i]
        if offsets[i] > source.shape[0] - size:
            raise ValueError(f"copy_records: record {i} ({size} bytes at {offsets[i]}) is outside the source "
                             f"({source.shape[0]} bytes)")
        if size == 0:
            continue
        last = destinations[i] + (planes[i] - 1) * plane_stride + (rows[i] - 1) * row_stride + row_bytes[i]
        if (planes[i] > 1 and plane_stride < rows[i] * row_stride) or (rows[i] > 1 and row_stride < row_bytes[i]) \
                or last > out.shape[0]:
            raise ValueError(f"copy_records: record {i}'s rows overlap or end outside the output "
                             f"({out.shape[0]} bytes)")
    with nogil:
        for i in range(count):
            size = row_bytes[i]
            if size == 0:
                continue
            for p in range(planes[i]):
                for r in range(rows[i]):
                    mmidx_stream_copy(&out[0] + destinations[i] + p * plane_stride + r * row_stride,
                                      &source[0] + offsets[i] + (p * rows[i] + r) * size, size)
        mmidx_stream_fence()
