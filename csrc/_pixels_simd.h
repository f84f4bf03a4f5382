/* The resize's two passes with explicit SSE4.1 and AVX2 intrinsics, and the table of kernels
 * csrc/_pixels.pyx chooses from at import (the best the CPU supports; set_kernel forces one).
 * Each gives exactly the scalar kernel's bytes (_pixels_rows.h), hence Pillow's.
 *
 * Exact sums with 16-bit multiplies. Pillow sums u8 pixel * int32 weight (22 fractional bits) in
 * int32. _mm_madd_epi16 multiplies int16 pairs and adds each pair into an int32, so every weight is
 * split as w = hi * 2^15 + lo with lo = w & 0x7fff in [0, 32767] and hi = w >> 15 (arithmetic),
 * which is in [-32768, 32767] while |w| < 2^30 (mmidx_split_pairs checks it, else the image takes
 * the scalar kernel; Pillow's normalised weights stay below 1.2 * 2^22). Two taps share one madd:
 * pixels (p_t, p_t+1) as int16 pairs times (hi_t, hi_t+1) and, separately, (lo_t, lo_t+1); an odd
 * last tap pairs with a zero pixel. No intermediate overflows:
 *  - a madd of pixels p <= 255 and parts |h| <= 2^15 is at most 2 * 255 * 2^15 < 2^24 in magnitude,
 *    exact in int32;
 *  - the running sums H = sum p * hi and L = HALF + sum p * lo, and (H << 15) + L, are computed with
 *    vector adds and shifts, which wrap modulo 2^32 (defined behaviour, unlike C's signed int), so
 *    (H << 15) + L is congruent modulo 2^32 to HALF + sum p * w, the sum Pillow computes;
 *  - that sum itself lies in int32: |sum p * w| <= 255 * sum |w| < 255 * 1.3 * 2^22 < 2^29 for
 *    Pillow's normalised bicubic weights (Pillow's own int accumulator relies on it), and the 8-bit
 *    clip between the passes keeps every pass's input in [0, 255].
 * So the recombined int32 equals Pillow's sum exactly, whatever the number of taps; the arithmetic
 * shift by 22 and the saturating packs (int32 -> int16 -> u8) are then Pillow's clip to [0, 255].
 *
 * Layouts. The vertical pass runs over whole rows, 32 (AVX2) or 16 (SSE4.1) output bytes at a time
 * with every tap summed in registers; a row's last partial chunk is recomputed overlapping the one
 * before (same bytes), rows narrower than one chunk take the scalar loop. The horizontal pass takes
 * MMIDX_BLOCK = 8 rows at once, byte-transposed so that one pixel's tap is 8 contiguous bytes per
 * channel: one madd covers 8 rows x 2 taps (AVX2) for one channel, three channels accumulate side by
 * side, and the 24 results are packed, shuffled to 8 rows x RGB and stored 4 bytes per row (the 4th
 * byte is overwritten by the next pixel; the row's last pixel stores 3). */
#ifndef MMIDX_PIXELS_SIMD_H
#define MMIDX_PIXELS_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_pixels_rows.h"

typedef void (*mmidx_vertical_fn)(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                  const int32_t *pairs, ptrdiff_t values, uint8_t *out);
typedef void (*mmidx_horizontal_fn)(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                    ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                    const int32_t *weights, const int32_t *pairs, ptrdiff_t ksize, ptrdiff_t width,
                                    uint8_t *out, ptrdiff_t out_stride, uint8_t *scratch);

typedef struct {
    const char *name;
    int simd;                      /* 1: the passes take the split weights of mmidx_split_pairs */
    mmidx_vertical_fn vertical;
    mmidx_horizontal_fn horizontal;
} mmidx_kernel;

/* The weights of n outputs (ksize each) as madd pairs: for output o and pair i, pairs[2 * (o * P + i)]
 * holds (hi of tap 2i, hi of tap 2i+1) as two int16 and the next int32 the two lo parts, P = (ksize + 1)
 * / 2 (a tap past ksize weighs 0). Returns 0, writing nothing useful, if a weight is out of the split's
 * range (|w| >= 2^30); the caller then takes the scalar kernel. */
static int mmidx_split_pairs(const int32_t *k, ptrdiff_t n, ptrdiff_t ksize, int32_t *pairs) {
    const ptrdiff_t P = (ksize + 1) / 2;
    for (ptrdiff_t o = 0; o < n; o++) {
        for (ptrdiff_t i = 0; i < P; i++) {
            const int32_t w0 = k[o * ksize + 2 * i], w1 = 2 * i + 1 < ksize ? k[o * ksize + 2 * i + 1] : 0;
            if (w0 >= (1 << 30) || w0 < -(1 << 30) || w1 >= (1 << 30) || w1 < -(1 << 30)) {
                return 0;
            }
            pairs[2 * (o * P + i)] = (int32_t)((uint32_t)(uint16_t)(w0 >> 15) | (uint32_t)(uint16_t)(w1 >> 15) << 16);
            pairs[2 * (o * P + i) + 1] = (int32_t)((uint32_t)(w0 & 0x7fff) | (uint32_t)(w1 & 0x7fff) << 16);
        }
    }
    return 1;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MMIDX_X86 1
#include <immintrin.h>

/* scratch[(j + i) * 8 + r] = in[r * row_stride + j + i] for i < 16, r < 8 (row r read as rows - 1 past
 * the last): an 8 x 16 byte transpose in SSE2, which every x86-64 has. */
static inline void mmidx_transpose16(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t rows, ptrdiff_t j,
                                     uint8_t *scratch) {
    __m128i r[8];
    for (int i = 0; i < 8; i++) {
        r[i] = _mm_loadu_si128((const __m128i *)(in + (i < rows ? i : rows - 1) * row_stride + j));
    }
    const __m128i a0 = _mm_unpacklo_epi8(r[0], r[1]), a1 = _mm_unpackhi_epi8(r[0], r[1]);
    const __m128i a2 = _mm_unpacklo_epi8(r[2], r[3]), a3 = _mm_unpackhi_epi8(r[2], r[3]);
    const __m128i a4 = _mm_unpacklo_epi8(r[4], r[5]), a5 = _mm_unpackhi_epi8(r[4], r[5]);
    const __m128i a6 = _mm_unpacklo_epi8(r[6], r[7]), a7 = _mm_unpackhi_epi8(r[6], r[7]);
    const __m128i b0 = _mm_unpacklo_epi16(a0, a2), b1 = _mm_unpackhi_epi16(a0, a2);   /* bytes 0-3, 4-7: rows 0-3 */
    const __m128i b2 = _mm_unpacklo_epi16(a1, a3), b3 = _mm_unpackhi_epi16(a1, a3);   /* bytes 8-11, 12-15 */
    const __m128i b4 = _mm_unpacklo_epi16(a4, a6), b5 = _mm_unpackhi_epi16(a4, a6);   /* the same, rows 4-7 */
    const __m128i b6 = _mm_unpacklo_epi16(a5, a7), b7 = _mm_unpackhi_epi16(a5, a7);
    __m128i *to = (__m128i *)(scratch + j * 8);
    _mm_storeu_si128(to + 0, _mm_unpacklo_epi32(b0, b4));
    _mm_storeu_si128(to + 1, _mm_unpackhi_epi32(b0, b4));
    _mm_storeu_si128(to + 2, _mm_unpacklo_epi32(b1, b5));
    _mm_storeu_si128(to + 3, _mm_unpackhi_epi32(b1, b5));
    _mm_storeu_si128(to + 4, _mm_unpacklo_epi32(b2, b6));
    _mm_storeu_si128(to + 5, _mm_unpackhi_epi32(b2, b6));
    _mm_storeu_si128(to + 6, _mm_unpacklo_epi32(b3, b7));
    _mm_storeu_si128(to + 7, _mm_unpackhi_epi32(b3, b7));
}

/* The first `span` bytes of 8 rows transposed into scratch (span * 8 bytes). */
static inline void mmidx_transpose_rows(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t rows, ptrdiff_t span,
                                        uint8_t *scratch) {
    if (span < 16) {
        for (ptrdiff_t r = 0; r < 8; r++) {
            for (ptrdiff_t j = 0; j < span; j++) {
                scratch[j * 8 + r] = in[(r < rows ? r : rows - 1) * row_stride + j];
            }
        }
        return;
    }
    for (ptrdiff_t j = 0; j < span; j += 16) {
        mmidx_transpose16(in, row_stride, rows, j + 16 <= span ? j : span - 16, scratch);
    }
}

/* Byte k of lane l (rows 4l..4l+3) of packus(packs(c0, c1), packs(c2, c2)) is channel k / 4 of row k % 4;
 * this puts row r's RGB at bytes 4r..4r+2. */
#define MMIDX_RGB_ROWS 0, 4, 8, -1, 1, 5, 9, -1, 2, 6, 10, -1, 3, 7, 11, -1

/* Store 8 rows' RGB: words[r] holds row r's pixel in its low 3 bytes; 4 bytes are stored (the 4th is the next
 * pixel's, written after) except for a row's last pixel. Constant-size copies: one store each. */
static inline void mmidx_store_rows(const uint32_t *words, ptrdiff_t rows, uint8_t *out, ptrdiff_t out_stride,
                                    int last) {
    if (!last && rows == MMIDX_BLOCK) {
        for (ptrdiff_t r = 0; r < MMIDX_BLOCK; r++) {
            memcpy(out + r * out_stride, &words[r], 4);
        }
        return;
    }
    for (ptrdiff_t r = 0; r < rows; r++) {
        if (last) {
            memcpy(out + r * out_stride, &words[r], 3);
        } else {
            memcpy(out + r * out_stride, &words[r], 4);
        }
    }
}

/* ------------------------------------------------------------------------------------------ AVX2 */

__attribute__((target("avx2")))
static void mmidx_vertical_avx2(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                const int32_t *pairs, ptrdiff_t values, uint8_t *restrict out) {
    if (values < 32) {
        mmidx_vertical_scalar(rows, row_stride, count, k, pairs, values, out);
        return;
    }
    const __m256i zero = _mm256_setzero_si256(), half = _mm256_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t i = 0; i < values; i += 32) {
        const ptrdiff_t at = i + 32 <= values ? i : values - 32;
        __m256i h0 = zero, h1 = zero, h2 = zero, h3 = zero, l0 = half, l1 = half, l2 = half, l3 = half;
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const __m256i a = _mm256_loadu_si256((const __m256i *)(rows + t * row_stride + at));
            const __m256i b = t + 1 < count ? _mm256_loadu_si256((const __m256i *)(rows + (t + 1) * row_stride + at))
                                            : zero;
            const __m256i wh = _mm256_set1_epi32(pairs[t]), wl = _mm256_set1_epi32(pairs[t + 1]);
            const __m256i lo = _mm256_unpacklo_epi8(a, b), hi = _mm256_unpackhi_epi8(a, b);
            __m256i p = _mm256_unpacklo_epi8(lo, zero);      /* bytes 0-3 | 16-19 as (p_t, p_t+1) pairs */
            h0 = _mm256_add_epi32(h0, _mm256_madd_epi16(p, wh));
            l0 = _mm256_add_epi32(l0, _mm256_madd_epi16(p, wl));
            p = _mm256_unpackhi_epi8(lo, zero);              /* bytes 4-7 | 20-23 */
            h1 = _mm256_add_epi32(h1, _mm256_madd_epi16(p, wh));
            l1 = _mm256_add_epi32(l1, _mm256_madd_epi16(p, wl));
            p = _mm256_unpacklo_epi8(hi, zero);              /* bytes 8-11 | 24-27 */
            h2 = _mm256_add_epi32(h2, _mm256_madd_epi16(p, wh));
            l2 = _mm256_add_epi32(l2, _mm256_madd_epi16(p, wl));
            p = _mm256_unpackhi_epi8(hi, zero);              /* bytes 12-15 | 28-31 */
            h3 = _mm256_add_epi32(h3, _mm256_madd_epi16(p, wh));
            l3 = _mm256_add_epi32(l3, _mm256_madd_epi16(p, wl));
        }
        h0 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h0, 15), l0), MMIDX_PRECISION_BITS);
        h1 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h1, 15), l1), MMIDX_PRECISION_BITS);
        h2 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h2, 15), l2), MMIDX_PRECISION_BITS);
        h3 = _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h3, 15), l3), MMIDX_PRECISION_BITS);
        /* Lane-wise packs undo the lane-wise unpacks: bytes come out in order. */
        const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(h0, h1), _mm256_packs_epi32(h2, h3));
        _mm256_storeu_si256((__m256i *)(out + at), bytes);
    }
}

__attribute__((target("avx2")))
static void mmidx_horizontal_avx2(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                  ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                  const int32_t *weights, const int32_t *pairs, ptrdiff_t ksize, ptrdiff_t width,
                                  uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    (void)weights;
    const ptrdiff_t P = (ksize + 1) / 2, ps = pixel_stride;
    mmidx_transpose_rows(in, row_stride, rows, (in_width - 1) * ps + 3, scratch);
    const __m256i half = _mm256_set1_epi32(MMIDX_HALF), zero = _mm256_setzero_si256();
    const __m256i rgb_rows = _mm256_setr_epi8(MMIDX_RGB_ROWS, MMIDX_RGB_ROWS);
    uint32_t words[8];
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t count = bounds[2 * x + 1];
        const uint8_t *taps = scratch + bounds[2 * x] * ps * 8;
        const int32_t *w = pairs + x * P * 2;
        __m256i h[3] = {zero, zero, zero}, l[3] = {half, half, half};
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const __m256i wh = _mm256_set1_epi32(w[t]), wl = _mm256_set1_epi32(w[t + 1]);
            for (int c = 0; c < 3; c++) {
                const __m128i a = _mm_loadl_epi64((const __m128i *)(taps + (t * ps + c) * 8));
                const __m128i b = t + 1 < count ? _mm_loadl_epi64((const __m128i *)(taps + ((t + 1) * ps + c) * 8))
                                                : _mm_setzero_si128();
                const __m256i p = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));   /* 8 rows' (p_t, p_t+1) */
                h[c] = _mm256_add_epi32(h[c], _mm256_madd_epi16(p, wh));
                l[c] = _mm256_add_epi32(l[c], _mm256_madd_epi16(p, wl));
            }
        }
        for (int c = 0; c < 3; c++) {
            h[c] = _mm256_srai_epi32(_mm256_add_epi32(_mm256_slli_epi32(h[c], 15), l[c]), MMIDX_PRECISION_BITS);
        }
        const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[2]));
        _mm256_storeu_si256((__m256i *)words, _mm256_shuffle_epi8(bytes, rgb_rows));
        mmidx_store_rows(words, rows, out + x * 3, out_stride, x == width - 1);
    }
}

/* ---------------------------------------------------------------------------------------- SSE4.1 */

__attribute__((target("sse4.1")))
static void mmidx_vertical_sse4(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                const int32_t *pairs, ptrdiff_t values, uint8_t *restrict out) {
    if (values < 16) {
        mmidx_vertical_scalar(rows, row_stride, count, k, pairs, values, out);
        return;
    }
    const __m128i zero = _mm_setzero_si128(), half = _mm_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t i = 0; i < values; i += 16) {
        const ptrdiff_t at = i + 16 <= values ? i : values - 16;
        __m128i h0 = zero, h1 = zero, h2 = zero, h3 = zero, l0 = half, l1 = half, l2 = half, l3 = half;
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const __m128i a = _mm_loadu_si128((const __m128i *)(rows + t * row_stride + at));
            const __m128i b = t + 1 < count ? _mm_loadu_si128((const __m128i *)(rows + (t + 1) * row_stride + at))
                                            : zero;
            const __m128i wh = _mm_set1_epi32(pairs[t]), wl = _mm_set1_epi32(pairs[t + 1]);
            const __m128i lo = _mm_unpacklo_epi8(a, b), hi = _mm_unpackhi_epi8(a, b);
            __m128i p = _mm_cvtepu8_epi16(lo);               /* bytes 0-3 as (p_t, p_t+1) pairs */
            h0 = _mm_add_epi32(h0, _mm_madd_epi16(p, wh));
            l0 = _mm_add_epi32(l0, _mm_madd_epi16(p, wl));
            p = _mm_unpackhi_epi8(lo, zero);                 /* bytes 4-7 */
            h1 = _mm_add_epi32(h1, _mm_madd_epi16(p, wh));
            l1 = _mm_add_epi32(l1, _mm_madd_epi16(p, wl));
            p = _mm_cvtepu8_epi16(hi);                       /* bytes 8-11 */
            h2 = _mm_add_epi32(h2, _mm_madd_epi16(p, wh));
            l2 = _mm_add_epi32(l2, _mm_madd_epi16(p, wl));
            p = _mm_unpackhi_epi8(hi, zero);                 /* bytes 12-15 */
            h3 = _mm_add_epi32(h3, _mm_madd_epi16(p, wh));
            l3 = _mm_add_epi32(l3, _mm_madd_epi16(p, wl));
        }
        h0 = _mm_srai_epi32(_mm_add_epi32(_mm_slli_epi32(h0, 15), l0), MMIDX_PRECISION_BITS);
        h1 = _mm_srai_epi32(_mm_add_epi32(_mm_slli_epi32(h1, 15), l1), MMIDX_PRECISION_BITS);
        h2 = _mm_srai_epi32(_mm_add_epi32(_mm_slli_epi32(h2, 15), l2), MMIDX_PRECISION_BITS);
        h3 = _mm_srai_epi32(_mm_add_epi32(_mm_slli_epi32(h3, 15), l3), MMIDX_PRECISION_BITS);
        _mm_storeu_si128((__m128i *)(out + at), _mm_packus_epi16(_mm_packs_epi32(h0, h1), _mm_packs_epi32(h2, h3)));
    }
}

__attribute__((target("sse4.1")))
static void mmidx_horizontal_sse4(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                  ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                  const int32_t *weights, const int32_t *pairs, ptrdiff_t ksize, ptrdiff_t width,
                                  uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    (void)weights;
    const ptrdiff_t P = (ksize + 1) / 2, ps = pixel_stride;
    mmidx_transpose_rows(in, row_stride, rows, (in_width - 1) * ps + 3, scratch);
    const __m128i half = _mm_set1_epi32(MMIDX_HALF), zero = _mm_setzero_si128();
    const __m128i rgb_rows = _mm_setr_epi8(MMIDX_RGB_ROWS);
    uint32_t words[8];
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t count = bounds[2 * x + 1];
        const uint8_t *taps = scratch + bounds[2 * x] * ps * 8;
        const int32_t *w = pairs + x * P * 2;
        __m128i h[6] = {zero, zero, zero, zero, zero, zero}, l[6] = {half, half, half, half, half, half};
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const __m128i wh = _mm_set1_epi32(w[t]), wl = _mm_set1_epi32(w[t + 1]);
            for (int c = 0; c < 3; c++) {
                const __m128i a = _mm_loadl_epi64((const __m128i *)(taps + (t * ps + c) * 8));
                const __m128i b = t + 1 < count ? _mm_loadl_epi64((const __m128i *)(taps + ((t + 1) * ps + c) * 8))
                                                : zero;
                const __m128i ab = _mm_unpacklo_epi8(a, b);
                const __m128i p0 = _mm_cvtepu8_epi16(ab), p1 = _mm_unpackhi_epi8(ab, zero);   /* rows 0-3, 4-7 */
                h[c] = _mm_add_epi32(h[c], _mm_madd_epi16(p0, wh));
                l[c] = _mm_add_epi32(l[c], _mm_madd_epi16(p0, wl));
                h[c + 3] = _mm_add_epi32(h[c + 3], _mm_madd_epi16(p1, wh));
                l[c + 3] = _mm_add_epi32(l[c + 3], _mm_madd_epi16(p1, wl));
            }
        }
        for (int c = 0; c < 6; c++) {
            h[c] = _mm_srai_epi32(_mm_add_epi32(_mm_slli_epi32(h[c], 15), l[c]), MMIDX_PRECISION_BITS);
        }
        const __m128i rows03 = _mm_packus_epi16(_mm_packs_epi32(h[0], h[1]), _mm_packs_epi32(h[2], h[2]));
        const __m128i rows47 = _mm_packus_epi16(_mm_packs_epi32(h[3], h[4]), _mm_packs_epi32(h[5], h[5]));
        _mm_storeu_si128((__m128i *)words, _mm_shuffle_epi8(rows03, rgb_rows));
        _mm_storeu_si128((__m128i *)(words + 4), _mm_shuffle_epi8(rows47, rgb_rows));
        mmidx_store_rows(words, rows, out + x * 3, out_stride, x == width - 1);
    }
}
#endif

/* The kernels in the order of preference, best last. */
static const mmidx_kernel mmidx_kernels[] = {
    {"scalar", 0, mmidx_vertical_scalar, mmidx_horizontal_scalar},
#ifdef MMIDX_X86
    {"sse4", 1, mmidx_vertical_sse4, mmidx_horizontal_sse4},
    {"avx2", 1, mmidx_vertical_avx2, mmidx_horizontal_avx2},
#endif
};
#define MMIDX_KERNELS ((int)(sizeof(mmidx_kernels) / sizeof(mmidx_kernels[0])))

/* Whether this CPU runs kernel i (every x86-64 CPU from 2008 on has SSE4.1, from 2013 on AVX2). */
static int mmidx_kernel_supported(int i) {
#ifdef MMIDX_X86
    __builtin_cpu_init();
    if (i == 1) {
        return __builtin_cpu_supports("sse4.1");
    }
    if (i == 2) {
        return __builtin_cpu_supports("avx2");
    }
#endif
    return i == 0;
}

#endif
