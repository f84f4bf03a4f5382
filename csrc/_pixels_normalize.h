/* The normalise step with AVX2: uint8 RGB rows -> torchvision's ToTensor + Normalize values as float32, 8 at a
 * time, for csrc/_pixels.pyx's output rows (CHW planes of padded_images, or patch rows of packed_vit_tokens).
 *
 * Exact values. The caller's (3, 256) table holds what torchvision computes for each level: the float32
 * operations level / 255, - mean, / std (ImageTransform.lookup_table). These functions run those very IEEE
 * operations (vcvtdq2ps, vdivps, vsubps, vdivps: each correctly rounded, as the scalar float32 operations are;
 * the last a vmulps by 1 / std where every std is a power of two, BAGEL's 0.5, the same quotient exactly),
 * so they give the table's values; csrc/_pixels.pyx still checks every level of every channel against the
 * table before each image (mmidx_levels_match) and looks values up instead should any differ, so an unusual
 * table (or a build that changed the float semantics) costs speed, never exactness. Measured on an AMD EPYC
 * (Zen): a gathered lookup (vgatherdps), exact by construction, was slower than the scalar loop; division by
 * reciprocal with an FMA correction (Markstein), also exact for these tables, slower than vdivps; streaming
 * stores no faster in a pack and slower into a buffer in cache. benchmarks/bench_resample.py times this
 * against the lookup (its 512² -> 512² row).
 *
 * `norm` is 6 floats: mean of R, G, B, then std of R, G, B. */
#ifndef MMIDX_PIXELS_NORMALIZE_H
#define MMIDX_PIXELS_NORMALIZE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Write pixels [0, n) of `row` (`pixel_stride` 3 or 4 bytes apart) as three planes; returns n, the pixels
 * done (a multiple of the vector width: the caller looks up the rest). */
typedef ptrdiff_t (*mmidx_planes_fn)(const uint8_t *row, ptrdiff_t pixel_stride, ptrdiff_t width,
                                     const float *norm, float *r, float *g, float *b);
/* Write `runs` runs of `count` >= 8 values of pixel-major RGB bytes (value i of a run is channel i % 3) one after
 * the other to `out`: run r is in[r * stride, r * stride + count) (the rows of one patch). */
typedef void (*mmidx_values_fn)(const uint8_t *in, ptrdiff_t stride, ptrdiff_t count, ptrdiff_t runs,
                                const float *norm, float *out);

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* Whether x / s is exactly x * (1 / s) for every float x: s a power of two (BAGEL's std, 0.5), normal, and
 * so is 1 / s. Then the second division becomes a multiplication, as fast and the same bits. */
static inline int mmidx_power_of_two(float s) {
    uint32_t bits;
    memcpy(&bits, &s, sizeof(bits));
    const uint32_t exponent = (bits >> 23) & 0xff;
    return (bits & 0x7fffff) == 0 && exponent > 1 && exponent < 0xfe;
}

/* The normalised values of 8 levels, one per int32 lane: the only arithmetic of this file. `divisor` is the
 * std, or 1 / std where `multiply` (all three stds powers of two). */
__attribute__((target("avx2")))
static inline __m256 mmidx_normalize_lanes(__m256i levels, __m256 mean, __m256 divisor, int multiply) {
    const __m256 value = _mm256_cvtepi32_ps(levels);
    const __m256 centred = _mm256_sub_ps(_mm256_div_ps(value, _mm256_set1_ps(255.0f)), mean);
    return multiply ? _mm256_mul_ps(centred, divisor) : _mm256_div_ps(centred, divisor);
}

/* The normalised values of the 8 levels in the low 8 bytes of `levels`. */
__attribute__((target("avx2")))
static inline __m256 mmidx_normalize8(__m128i levels, __m256 mean, __m256 divisor, int multiply) {
    return mmidx_normalize_lanes(_mm256_cvtepu8_epi32(levels), mean, divisor, multiply);
}

/* Each channel's std as mmidx_normalize_lanes takes it, into divisor[3]; returns its `multiply`. */
static inline int mmidx_divisors(const float *norm, float *divisor) {
    const int multiply = mmidx_power_of_two(norm[3]) && mmidx_power_of_two(norm[4]) && mmidx_power_of_two(norm[5]);
    for (int c = 0; c < 3; c++) {
        divisor[c] = multiply ? 1.0f / norm[3 + c] : norm[3 + c];
    }
    return multiply;
}

__attribute__((target("avx2")))
static ptrdiff_t mmidx_planes_avx2(const uint8_t *row, ptrdiff_t pixel_stride, ptrdiff_t width, const float *norm,
                                   float *r, float *g, float *b) {
    float *planes[3] = {r, g, b};
    float divisor[3];
    const int multiply = mmidx_divisors(norm, divisor);
    __m256 mean[3], divisor_of[3];
    for (int c = 0; c < 3; c++) {
        mean[c] = _mm256_set1_ps(norm[c]);
        divisor_of[c] = _mm256_set1_ps(divisor[c]);
    }
    ptrdiff_t x = 0;
    if (pixel_stride == 3) {
        /* 16 pixels = 48 bytes in three loads; byte shuffles gather each channel's 16 levels
         * (pick[c][k]: the bytes of channel c in load k, -1 clearing the others). */
        const __m128i pick[3][3] = {
            {_mm_setr_epi8(0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 1, 4, 7, 10, 13)},
            {_mm_setr_epi8(1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 2, 5, 8, 11, 14)},
            {_mm_setr_epi8(2, 5, 8, 11, 14, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, 1, 4, 7, 10, 13, -1, -1, -1, -1, -1, -1),
             _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 3, 6, 9, 12, 15)}};
        for (; x + 16 <= width; x += 16) {
            const __m128i load[3] = {_mm_loadu_si128((const __m128i *)(row + 3 * x)),
                                     _mm_loadu_si128((const __m128i *)(row + 3 * x + 16)),
                                     _mm_loadu_si128((const __m128i *)(row + 3 * x + 32))};
            for (int c = 0; c < 3; c++) {
                const __m128i levels = _mm_or_si128(_mm_or_si128(_mm_shuffle_epi8(load[0], pick[c][0]),
                                                                 _mm_shuffle_epi8(load[1], pick[c][1])),
                                                    _mm_shuffle_epi8(load[2], pick[c][2]));
                _mm256_storeu_ps(planes[c] + x, mmidx_normalize8(levels, mean[c], divisor_of[c], multiply));
                _mm256_storeu_ps(planes[c] + x + 8,
                                 mmidx_normalize8(_mm_srli_si128(levels, 8), mean[c], divisor_of[c], multiply));
            }
        }
    } else if (pixel_stride == 4) {
        /* 8 RGBX pixels = 32 bytes: channel c is byte c of each 32-bit lane (the X byte is never used). */
        const __m256i low_byte = _mm256_set1_epi32(0xff);
        for (; x + 8 <= width; x += 8) {
            const __m256i pixels = _mm256_loadu_si256((const __m256i *)(row + 4 * x));
            for (int c = 0; c < 3; c++) {
                const __m256i levels = _mm256_and_si256(_mm256_srli_epi32(pixels, 8 * c), low_byte);
                _mm256_storeu_ps(planes[c] + x, mmidx_normalize_lanes(levels, mean[c], divisor_of[c], multiply));
            }
        }
    }
    return x;
}

__attribute__((target("avx2")))
static void mmidx_values_avx2(const uint8_t *in, ptrdiff_t stride, ptrdiff_t count, ptrdiff_t runs,
                              const float *norm, float *out) {
    /* Value i is channel i % 3, so a vector starting at value i needs the constants of phase i % 3. */
    float divisor[3];
    const int multiply = mmidx_divisors(norm, divisor);
    __m256 mean[3], divisor_of[3];
    for (int p = 0; p < 3; p++) {
        mean[p] = _mm256_setr_ps(norm[p % 3], norm[(p + 1) % 3], norm[(p + 2) % 3], norm[p % 3],
                                 norm[(p + 1) % 3], norm[(p + 2) % 3], norm[p % 3], norm[(p + 1) % 3]);
        divisor_of[p] = _mm256_setr_ps(divisor[p % 3], divisor[(p + 1) % 3], divisor[(p + 2) % 3],
                                       divisor[p % 3], divisor[(p + 1) % 3], divisor[(p + 2) % 3],
                                       divisor[p % 3], divisor[(p + 1) % 3]);
    }
    const int last = (int)((count - 8) % 3);
    for (ptrdiff_t r = 0; r < runs; r++, in += stride, out += count) {
        ptrdiff_t i = 0;
        int p = 0;                         /* (8 * k) % 3 steps 0, 2, 1, 0, ... */
        for (; i + 8 <= count; i += 8, p = p ? p - 1 : 2) {
            const __m128i levels = _mm_loadl_epi64((const __m128i *)(in + i));
            _mm256_storeu_ps(out + i, mmidx_normalize8(levels, mean[p], divisor_of[p], multiply));
        }
        if (i < count) {   /* the last 8 values, overlapping ones already written (with the same values) */
            const __m128i levels = _mm_loadl_epi64((const __m128i *)(in + count - 8));
            _mm256_storeu_ps(out + count - 8, mmidx_normalize8(levels, mean[last], divisor_of[last], multiply));
        }
    }
}
#endif

#endif
