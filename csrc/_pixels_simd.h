/* The resize's two passes with explicit SSE4.1 and AVX2 intrinsics, and the table of kernels
 * csrc/_pixels.pyx chooses from at import (the best the CPU supports; set_kernel forces one).
 * Each gives exactly the scalar kernel's bytes (_pixels_rows.h), hence Pillow's.
 *
 * Exact sums. Pillow sums u8 pixel * int32 weight (22 fractional bits) in int32, starting at one half,
 * then shifts by 22 and clips to [0, 255]. These kernels do the same operations on 4 (SSE4.1) or 8
 * (AVX2) int32 lanes: pixels zero-extended to int32 (pmovzxbd), multiplied by the broadcast weight
 * (pmulld, the low 32 bits of the product), added (paddd), shifted (psrad), then packed with signed
 * then unsigned saturation (int32 -> int16 -> u8), which is the clip to [0, 255] for any int32 >> 22.
 * Every product and partial sum is the one the scalar loop computes (|p * w| <= 255 * 1.2 * 2^22 <
 * 2^31 for Pillow's normalised weights, and the sum is the int32 Pillow itself accumulates), and
 * vector adds wrap modulo 2^32 anyway, so the order of the additions cannot change a result.
 * The "avx2-madd" kernel multiplies two taps per instruction instead: each weight is split as w = hi * 2^16 + lo,
 * hi = (w + 2^15) >> 16 (arithmetic), lo = w - hi * 2^16 in [-2^15, 2^15), an int16; pixels (p_t, p_t+1) as int16
 * pairs times (lo_t, lo_t+1) sum with pmaddwd into L = HALF + sum p * lo (a madd is below 2^24 in magnitude, L
 * below 2^31 for fewer than 254 taps), and the same pixels as byte pairs times (hi_t, hi_t+1) as int8 sum with
 * pmaddubsw into H = sum p * hi in int16 lanes, half as many multiply micro-ops as another pmaddwd: exact where
 * sum |hi| <= 127 over an output's taps (no pair's product and no partial sum then leaves [-32385, 32385], so
 * nothing saturates or wraps), which mmidx_split_pairs checks (Pillow's normalised weights sum to 1 with small
 * negative lobes: sum |hi| was 64-80 for every size from 47 -> 1 to 3 -> 4000; only downscales by over 60x, 254
 * taps or more, take the pmulld kernel). Then L + (H << 16), with wrapping vector adds and shifts, is
 * congruent modulo 2^32 to HALF + sum p * w, which lies in int32 (Pillow's own accumulator relies on it): the
 * same sum, whatever the number of taps. A tap past the last weighs 0. Which
 * multiply is faster depends on the CPU: pmulld was 10-18% faster on an AMD Zen 3 than pmaddwd on weights split
 * in two 15-bit halves, which was 1.25x pmulld on a Zen 1 (benchmarks/bench_resample.py); mmidx_default_kernel
 * picks by CPU family.
 *
 * Layouts. The vertical pass runs over whole rows, 32 (AVX2) or 16 (SSE4.1) output bytes at a time
 * with every tap summed in registers; a row's last partial chunk is recomputed overlapping the one
 * before (same bytes), rows narrower than one chunk take the scalar loop. The horizontal pass takes
 * MMIDX_BLOCK = 8 rows at once, byte-transposed (SSE2 unpacks) so that one tap of one channel is 8
 * contiguous bytes, one per row: 8 rows x 1 tap per multiply, three channels side by side; the 24
 * results are packed, shuffled to 8 rows x RGB and stored 4 bytes per row (the 4th byte is the next
 * pixel's, written after; a row's last pixel stores 3). */
#ifndef MMIDX_PIXELS_SIMD_H
#define MMIDX_PIXELS_SIMD_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "_pixels_normalize.h"
#include "_pixels_rows.h"

typedef void (*mmidx_vertical_fn)(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                  ptrdiff_t values, uint8_t *out);
typedef void (*mmidx_horizontal_fn)(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                    ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                    const int32_t *weights, ptrdiff_t ksize, ptrdiff_t width,
                                    uint8_t *out, ptrdiff_t out_stride, uint8_t *scratch);

typedef struct {
    const char *name;
    mmidx_vertical_fn vertical;
    mmidx_horizontal_fn horizontal;
    mmidx_planes_fn planes;    /* the normalise step (_pixels_normalize.h), or NULL: the table is looked up */
    mmidx_values_fn values;
    int pairs;                 /* 1: the passes take weights split into madd pairs (mmidx_split_pairs) */
    int whole;                 /* the kernel of the same passes on whole weights, where they do not split */
} mmidx_kernel;

/* The weights of n outputs (ksize each) as madd pairs: output o's pair i is pairs[o * P2 + 2 i] = (lo of tap 2i,
 * lo of tap 2i+1) as two int16, then pairs[o * P2 + 2 i + 1] = (hi of tap 2i, hi of tap 2i+1) as two int8 in its low
 * 16 bits, P2 = ksize rounded up to even (a tap past ksize weighs 0). Returns 0 where the split is not exact (an
 * output's sum |hi| above 127, or 254 taps or more): the caller then takes a kernel that multiplies whole weights. */
static int mmidx_split_pairs(const int32_t *k, ptrdiff_t n, ptrdiff_t ksize, int32_t *pairs) {
    const ptrdiff_t P2 = (ksize + 1) / 2 * 2;
    if (P2 >= 254) {
        return 0;
    }
    for (ptrdiff_t o = 0; o < n; o++) {
        int64_t spread = 0;                        /* sum |hi| */
        for (ptrdiff_t t = 0; t < P2; t += 2) {
            int32_t hi[2], lo[2];
            for (int j = 0; j < 2; j++) {
                const int64_t w = t + j < ksize ? k[o * ksize + t + j] : 0;
                hi[j] = (int32_t)((w + 32768) >> 16);
                lo[j] = (int32_t)(w - (int64_t)hi[j] * 65536);
                spread += hi[j] < 0 ? -(int64_t)hi[j] : hi[j];
            }
            if (spread > 127) {
                return 0;
            }
            pairs[o * P2 + t] = (int32_t)((uint32_t)(uint16_t)lo[0] | (uint32_t)(uint16_t)lo[1] << 16);
            pairs[o * P2 + t + 1] = (int32_t)((uint32_t)(uint8_t)hi[0] | (uint32_t)(uint8_t)hi[1] << 8);
        }
    }
    return 1;
}

/* Tap t's weight rebuilt from its pair (hi * 2^16 + lo): the int32 it was split from. */
static inline int32_t mmidx_pair_weight(const int32_t *pairs, ptrdiff_t t) {
    const ptrdiff_t at = t & ~(ptrdiff_t)1;
    const int shift = (int)(t & 1);
    const int32_t lo = (int16_t)(uint16_t)((uint32_t)pairs[at] >> (16 * shift));
    const int32_t hi = (int8_t)(uint8_t)((uint32_t)pairs[at + 1] >> (8 * shift));
    return (int32_t)((uint32_t)hi * 65536u + (uint32_t)lo);
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

/* The first `span` bytes of 8 rows transposed into scratch (span * 8 bytes; the last 16 overlap). */
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

/* Exact int32 sums (22 fractional bits) to 8-bit values, as every AVX2 pass ends: shifted by 22, packed with
 * saturation (the clip to [0, 255]). mmidx_store_values32 stores 32 sums of one row in order; mmidx_store_block8
 * stores the R, G and B sums of 8 rows as one pixel of each row (mmidx_store_rows). */
__attribute__((target("avx2")))
static inline void mmidx_store_values32(__m256i s0, __m256i s1, __m256i s2, __m256i s3, uint8_t *out) {
    const __m256i in_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);   /* undoes the lane-wise packs */
    s0 = _mm256_srai_epi32(s0, MMIDX_PRECISION_BITS);
    s1 = _mm256_srai_epi32(s1, MMIDX_PRECISION_BITS);
    s2 = _mm256_srai_epi32(s2, MMIDX_PRECISION_BITS);
    s3 = _mm256_srai_epi32(s3, MMIDX_PRECISION_BITS);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(s0, s1), _mm256_packs_epi32(s2, s3));
    _mm256_storeu_si256((__m256i *)out, _mm256_permutevar8x32_epi32(bytes, in_order));
}

__attribute__((target("avx2")))
static inline void mmidx_store_block8(__m256i r, __m256i g, __m256i b, ptrdiff_t rows, uint8_t *out,
                                      ptrdiff_t out_stride, int last) {
    const __m256i rgb_rows = _mm256_setr_epi8(MMIDX_RGB_ROWS, MMIDX_RGB_ROWS);
    uint32_t words[8];
    r = _mm256_srai_epi32(r, MMIDX_PRECISION_BITS);
    g = _mm256_srai_epi32(g, MMIDX_PRECISION_BITS);
    b = _mm256_srai_epi32(b, MMIDX_PRECISION_BITS);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packs_epi32(r, g), _mm256_packs_epi32(b, b));
    _mm256_storeu_si256((__m256i *)words, _mm256_shuffle_epi8(bytes, rgb_rows));
    mmidx_store_rows(words, rows, out, out_stride, last);
}

/* A madd pass's sum from its parts: L + (H << 16), H's int16 lanes widened, wrapping: Pillow's int32 sum (the
 * header says why). */
__attribute__((target("avx2")))
static inline __m256i mmidx_recombine(__m256i low, __m128i high) {
    return _mm256_add_epi32(low, _mm256_slli_epi32(_mm256_cvtepi16_epi32(high), 16));
}

__attribute__((target("avx2")))
static void mmidx_vertical_avx2(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                ptrdiff_t values, uint8_t *restrict out) {
    if (values < 32) {
        mmidx_vertical_scalar(rows, row_stride, count, k, values, out);
        return;
    }
    const __m256i half = _mm256_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t i = 0; i < values; i += 32) {
        const ptrdiff_t at = i + 32 <= values ? i : values - 32;
        __m256i s0 = half, s1 = half, s2 = half, s3 = half;
        for (ptrdiff_t t = 0; t < count; t++) {
            const uint8_t *line = rows + t * row_stride + at;
            const __m256i w = _mm256_set1_epi32(k[t]);
            s0 = _mm256_add_epi32(s0, _mm256_mullo_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)line)), w));
            s1 = _mm256_add_epi32(s1, _mm256_mullo_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(line + 8))), w));
            s2 = _mm256_add_epi32(s2, _mm256_mullo_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(line + 16))), w));
            s3 = _mm256_add_epi32(s3, _mm256_mullo_epi32(
                _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(line + 24))), w));
        }
        mmidx_store_values32(s0, s1, s2, s3, out + at);
    }
}

__attribute__((target("avx2")))
static void mmidx_horizontal_avx2(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                  ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                  const int32_t *weights, ptrdiff_t ksize, ptrdiff_t width,
                                  uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    const ptrdiff_t ps = pixel_stride;
    mmidx_transpose_rows(in, row_stride, rows, (in_width - 1) * ps + 3, scratch);
    const __m256i half = _mm256_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t count = bounds[2 * x + 1];
        const uint8_t *taps = scratch + bounds[2 * x] * ps * 8;
        const int32_t *k = weights + x * ksize;
        __m256i s[3] = {half, half, half};      /* channel c of rows 0-7 */
        for (ptrdiff_t t = 0; t < count; t++) {
            const __m256i w = _mm256_set1_epi32(k[t]);
            for (int c = 0; c < 3; c++) {
                const __m256i p = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(taps + (t * ps + c) * 8)));
                s[c] = _mm256_add_epi32(s[c], _mm256_mullo_epi32(p, w));
            }
        }
        mmidx_store_block8(s[0], s[1], s[2], rows, out + x * 3, out_stride, x == width - 1);
    }
}

/* The same passes with pmaddwd and pmaddubsw on split weights (mmidx_split_pairs: `k` / `weights` hold P2 int32
 * per output, `ksize` is P2). The vertical pass pairs rows t and t+1 byte by byte (a missing row t+1 weighs 0 and
 * reads row t); the horizontal pass pairs taps t and t+1 of the transposed block, whose tail the caller
 * leaves room for and this zeroes (the tap after an odd count weighs 0). */
__attribute__((target("avx2")))
static void mmidx_vertical_avx2_madd(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                     ptrdiff_t values, uint8_t *restrict out) {
    if (values < 32) {
        for (ptrdiff_t i = 0; i < values; i++) {
            int32_t sum = MMIDX_HALF;
            for (ptrdiff_t t = 0; t < count; t++) {
                sum += rows[t * row_stride + i] * mmidx_pair_weight(k, t);
            }
            out[i] = mmidx_clip8(sum);
        }
        return;
    }
    const __m256i half = _mm256_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t i = 0; i < values; i += 32) {
        const ptrdiff_t at = i + 32 <= values ? i : values - 32;
        __m256i l0 = half, l1 = half, l2 = half, l3 = half;
        __m128i h0 = _mm_setzero_si128(), h1 = h0, h2 = h0, h3 = h0;
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const uint8_t *a = rows + t * row_stride + at, *b = t + 1 < count ? a + row_stride : a;
            const __m256i wl = _mm256_set1_epi32(k[t]);
            const __m128i wh = _mm_set1_epi16((int16_t)k[t + 1]);
            const __m128i a0 = _mm_loadu_si128((const __m128i *)a), b0 = _mm_loadu_si128((const __m128i *)b);
            const __m128i a1 = _mm_loadu_si128((const __m128i *)(a + 16));
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(b + 16));
            __m128i p = _mm_unpacklo_epi8(a0, b0);                   /* values 0-7 as byte pairs (p_t, p_t+1) */
            l0 = _mm256_add_epi32(l0, _mm256_madd_epi16(_mm256_cvtepu8_epi16(p), wl));
            h0 = _mm_add_epi16(h0, _mm_maddubs_epi16(p, wh));
            p = _mm_unpackhi_epi8(a0, b0);                           /* 8-15 */
            l1 = _mm256_add_epi32(l1, _mm256_madd_epi16(_mm256_cvtepu8_epi16(p), wl));
            h1 = _mm_add_epi16(h1, _mm_maddubs_epi16(p, wh));
            p = _mm_unpacklo_epi8(a1, b1);                           /* 16-23 */
            l2 = _mm256_add_epi32(l2, _mm256_madd_epi16(_mm256_cvtepu8_epi16(p), wl));
            h2 = _mm_add_epi16(h2, _mm_maddubs_epi16(p, wh));
            p = _mm_unpackhi_epi8(a1, b1);                           /* 24-31 */
            l3 = _mm256_add_epi32(l3, _mm256_madd_epi16(_mm256_cvtepu8_epi16(p), wl));
            h3 = _mm_add_epi16(h3, _mm_maddubs_epi16(p, wh));
        }
        mmidx_store_values32(mmidx_recombine(l0, h0), mmidx_recombine(l1, h1), mmidx_recombine(l2, h2),
                             mmidx_recombine(l3, h3), out + at);
    }
}

__attribute__((target("avx2")))
static void mmidx_horizontal_avx2_madd(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                       ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                       const int32_t *weights, ptrdiff_t ksize, ptrdiff_t width,
                                       uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    const ptrdiff_t ps = pixel_stride, span = (in_width - 1) * ps + 3;
    mmidx_transpose_rows(in, row_stride, rows, span, scratch);
    memset(scratch + span * 8, 0, (ps + 1) * 8);     /* the tap after the last pixel, weighing 0 */
    const __m256i half = _mm256_set1_epi32(MMIDX_HALF);
    const __m128i zero = _mm_setzero_si128();
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t count = bounds[2 * x + 1];
        const uint8_t *taps = scratch + bounds[2 * x] * ps * 8;
        const int32_t *k = weights + x * ksize;
        __m256i l[3] = {half, half, half};     /* channel c of rows 0-7 */
        __m128i h[3] = {zero, zero, zero};
        for (ptrdiff_t t = 0; t < count; t += 2) {
            const __m256i wl = _mm256_set1_epi32(k[t]);
            const __m128i wh = _mm_set1_epi16((int16_t)k[t + 1]);
            for (int c = 0; c < 3; c++) {
                const __m128i a = _mm_loadl_epi64((const __m128i *)(taps + (t * ps + c) * 8));
                const __m128i b = _mm_loadl_epi64((const __m128i *)(taps + ((t + 1) * ps + c) * 8));
                const __m128i p = _mm_unpacklo_epi8(a, b);          /* 8 rows' (p_t, p_t+1) as bytes */
                l[c] = _mm256_add_epi32(l[c], _mm256_madd_epi16(_mm256_cvtepu8_epi16(p), wl));
                h[c] = _mm_add_epi16(h[c], _mm_maddubs_epi16(p, wh));
            }
        }
        mmidx_store_block8(mmidx_recombine(l[0], h[0]), mmidx_recombine(l[1], h[1]), mmidx_recombine(l[2], h[2]),
                           rows, out + x * 3, out_stride, x == width - 1);
    }
}

/* ---------------------------------------------------------------------------------------- SSE4.1 */

__attribute__((target("sse4.1")))
static void mmidx_vertical_sse4(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                ptrdiff_t values, uint8_t *restrict out) {
    if (values < 16) {
        mmidx_vertical_scalar(rows, row_stride, count, k, values, out);
        return;
    }
    const __m128i half = _mm_set1_epi32(MMIDX_HALF);
    for (ptrdiff_t i = 0; i < values; i += 16) {
        const ptrdiff_t at = i + 16 <= values ? i : values - 16;
        __m128i s0 = half, s1 = half, s2 = half, s3 = half;
        for (ptrdiff_t t = 0; t < count; t++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(rows + t * row_stride + at));
            const __m128i w = _mm_set1_epi32(k[t]);
            s0 = _mm_add_epi32(s0, _mm_mullo_epi32(_mm_cvtepu8_epi32(v), w));
            s1 = _mm_add_epi32(s1, _mm_mullo_epi32(_mm_cvtepu8_epi32(_mm_srli_si128(v, 4)), w));
            s2 = _mm_add_epi32(s2, _mm_mullo_epi32(_mm_cvtepu8_epi32(_mm_srli_si128(v, 8)), w));
            s3 = _mm_add_epi32(s3, _mm_mullo_epi32(_mm_cvtepu8_epi32(_mm_srli_si128(v, 12)), w));
        }
        s0 = _mm_srai_epi32(s0, MMIDX_PRECISION_BITS);
        s1 = _mm_srai_epi32(s1, MMIDX_PRECISION_BITS);
        s2 = _mm_srai_epi32(s2, MMIDX_PRECISION_BITS);
        s3 = _mm_srai_epi32(s3, MMIDX_PRECISION_BITS);
        _mm_storeu_si128((__m128i *)(out + at), _mm_packus_epi16(_mm_packs_epi32(s0, s1), _mm_packs_epi32(s2, s3)));
    }
}

__attribute__((target("sse4.1")))
static void mmidx_horizontal_sse4(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                  ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                  const int32_t *weights, ptrdiff_t ksize, ptrdiff_t width,
                                  uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    const ptrdiff_t ps = pixel_stride;
    mmidx_transpose_rows(in, row_stride, rows, (in_width - 1) * ps + 3, scratch);
    const __m128i half = _mm_set1_epi32(MMIDX_HALF);
    const __m128i rgb_rows = _mm_setr_epi8(MMIDX_RGB_ROWS);
    uint32_t words[8];
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t count = bounds[2 * x + 1];
        const uint8_t *taps = scratch + bounds[2 * x] * ps * 8;
        const int32_t *k = weights + x * ksize;
        __m128i s[6] = {half, half, half, half, half, half};   /* s[c]: channel c of rows 0-3, s[c + 3]: 4-7 */
        for (ptrdiff_t t = 0; t < count; t++) {
            const __m128i w = _mm_set1_epi32(k[t]);
            for (int c = 0; c < 3; c++) {
                const __m128i v = _mm_loadl_epi64((const __m128i *)(taps + (t * ps + c) * 8));
                s[c] = _mm_add_epi32(s[c], _mm_mullo_epi32(_mm_cvtepu8_epi32(v), w));
                s[c + 3] = _mm_add_epi32(s[c + 3], _mm_mullo_epi32(_mm_cvtepu8_epi32(_mm_srli_si128(v, 4)), w));
            }
        }
        for (int c = 0; c < 6; c++) {
            s[c] = _mm_srai_epi32(s[c], MMIDX_PRECISION_BITS);
        }
        const __m128i rows03 = _mm_packus_epi16(_mm_packs_epi32(s[0], s[1]), _mm_packs_epi32(s[2], s[2]));
        const __m128i rows47 = _mm_packus_epi16(_mm_packs_epi32(s[3], s[4]), _mm_packs_epi32(s[5], s[5]));
        _mm_storeu_si128((__m128i *)words, _mm_shuffle_epi8(rows03, rgb_rows));
        _mm_storeu_si128((__m128i *)(words + 4), _mm_shuffle_epi8(rows47, rgb_rows));
        mmidx_store_rows(words, rows, out + x * 3, out_stride, x == width - 1);
    }
}
#endif

/* The kernels: scalar, then SSE4.1, then the two AVX2 ones (mmidx_default_kernel chooses between them). */
static const mmidx_kernel mmidx_kernels[] = {
    {"scalar", mmidx_vertical_scalar, mmidx_horizontal_scalar, NULL, NULL, 0, 0},
#ifdef MMIDX_X86
    {"sse4", mmidx_vertical_sse4, mmidx_horizontal_sse4, NULL, NULL, 0, 1},
    {"avx2", mmidx_vertical_avx2, mmidx_horizontal_avx2, mmidx_planes_avx2, mmidx_values_avx2, 0, 2},
    {"avx2-madd", mmidx_vertical_avx2_madd, mmidx_horizontal_avx2_madd, mmidx_planes_avx2, mmidx_values_avx2, 1, 2},
#endif
};
#define MMIDX_KERNELS ((int)(sizeof(mmidx_kernels) / sizeof(mmidx_kernels[0])))

#ifdef MMIDX_X86
#include <cpuid.h>

/* The CPU's family as AMD and Intel number it: the base family, plus the extended family when it is 0xf. */
static int mmidx_cpu_family(void) {
    unsigned int eax, ebx, ecx, edx;
    if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) {
        return 0;
    }
    const int base = (eax >> 8) & 0xf;
    return base == 0xf ? base + (int)((eax >> 20) & 0xff) : base;
}
#endif

/* Whether this CPU runs kernel i (x86-64 CPUs have SSE4.1 from about 2008, AVX2 from 2013). */
static int mmidx_kernel_supported(int i) {
#ifdef MMIDX_X86
    __builtin_cpu_init();
    if (i == 1) {
        return __builtin_cpu_supports("sse4.1");
    }
    if (i == 2 || i == 3) {
        return __builtin_cpu_supports("avx2");
    }
#endif
    return i == 0;
}

/* The kernel used unless set_kernel chooses another: the AVX2 one whose multiply is faster on this CPU, else
 * SSE4.1, else scalar. pmulld on AMD from Zen 3 (CPU family 0x19) on, where it measured 10-18% faster than the
 * split kernel's earlier form (both halves with pmaddwd; the present one is not measured there); the split kernel
 * (pmaddwd and pmaddubsw) elsewhere: 1.4x pmulld on a Zen 1 (family 0x17), and on Intel cores, where instruction
 * tables give pmulld two micro-ops to pmaddwd's one (not measured here). */
static int mmidx_default_kernel(void) {
#ifdef MMIDX_X86
    if (mmidx_kernel_supported(2)) {
        return __builtin_cpu_is("amd") && mmidx_cpu_family() >= 0x19 ? 2 : 3;
    }
    if (mmidx_kernel_supported(1)) {
        return 1;
    }
#endif
    return 0;
}

#endif
