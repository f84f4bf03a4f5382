/* The two inner loops of the resize in csrc/_pixels.pyx in portable C: the "scalar" kernel, the
 * reference the SIMD kernels of _pixels_simd.h are tested against and the one that runs on CPUs
 * without SSE4.1 and off x86-64. Compiled for the baseline ISA (the compiler may still vectorise
 * what it can there). Integer arithmetic throughout: Pillow's exact sums. */
#ifndef MMIDX_PIXELS_ROWS_H
#define MMIDX_PIXELS_ROWS_H

#include <stddef.h>
#include <stdint.h>

#define MMIDX_PRECISION_BITS 22
#define MMIDX_HALF (1 << (MMIDX_PRECISION_BITS - 1))
#define MMIDX_BLOCK 8
#define MMIDX_CHUNK 256

static inline uint8_t mmidx_clip8(int32_t value) {
    value >>= MMIDX_PRECISION_BITS;
    return value < 0 ? 0 : value > 255 ? 255 : (uint8_t)value;
}

/* One output row of the vertical pass: out[i] = clip8(HALF + sum_t rows[t * row_stride + i] * k[t])
 * for i < values, the rows' bytes taken as they lie (3 or 4 bytes per pixel alike). Runs MMIDX_CHUNK
 * values at a time so that the sums stay in the cache. */
static void mmidx_vertical_scalar(const uint8_t *rows, ptrdiff_t row_stride, ptrdiff_t count, const int32_t *k,
                                  ptrdiff_t values, uint8_t *restrict out) {
    int32_t sums[MMIDX_CHUNK];
    for (ptrdiff_t first = 0; first < values; first += MMIDX_CHUNK) {
        const ptrdiff_t n = values - first < MMIDX_CHUNK ? values - first : MMIDX_CHUNK;
        for (ptrdiff_t i = 0; i < n; i++) {
            sums[i] = MMIDX_HALF;
        }
        for (ptrdiff_t t = 0; t < count; t++) {
            const uint8_t *line = rows + t * row_stride + first;
            const int32_t weight = k[t];
            for (ptrdiff_t i = 0; i < n; i++) {
                sums[i] += line[i] * weight;
            }
        }
        for (ptrdiff_t i = 0; i < n; i++) {
            out[first + i] = mmidx_clip8(sums[i]);
        }
    }
}

/* The horizontal pass of `rows` (at most MMIDX_BLOCK) consecutive RGB rows at once: the rows are
 * interleaved into `scratch` (in_width * 4 * MMIDX_BLOCK bytes) so that each tap is one 8-lane
 * multiply-add over the rows; output row r goes to out + r * out_stride (3 bytes per pixel).
 * `bounds` holds (first input, count) per output, `weights` ksize weights per output. */
static void mmidx_horizontal_scalar(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
                                    ptrdiff_t in_width, ptrdiff_t rows, const ptrdiff_t *bounds,
                                    const int32_t *weights, ptrdiff_t ksize, ptrdiff_t width,
                                    uint8_t *restrict out, ptrdiff_t out_stride, uint8_t *restrict scratch) {
    for (ptrdiff_t r = 0; r < MMIDX_BLOCK; r++) {
        const uint8_t *line = in + (r < rows ? r : rows - 1) * row_stride;   /* pad with the last row */
        for (ptrdiff_t x = 0; x < in_width; x++) {
            for (int c = 0; c < 3; c++) {
                scratch[(x * 3 + c) * MMIDX_BLOCK + r] = line[x * pixel_stride + c];
            }
        }
    }
    for (ptrdiff_t x = 0; x < width; x++) {
        const ptrdiff_t start = bounds[2 * x], count = bounds[2 * x + 1];
        const int32_t *k = weights + x * ksize;
        for (int c = 0; c < 3; c++) {
            int32_t sums[MMIDX_BLOCK];
            for (int r = 0; r < MMIDX_BLOCK; r++) {
                sums[r] = MMIDX_HALF;
            }
            for (ptrdiff_t t = 0; t < count; t++) {
                const uint8_t *column = scratch + ((start + t) * 3 + c) * MMIDX_BLOCK;
                const int32_t weight = k[t];
                for (int r = 0; r < MMIDX_BLOCK; r++) {
                    sums[r] += column[r] * weight;
                }
            }
            for (ptrdiff_t r = 0; r < rows; r++) {
                out[r * out_stride + x * 3 + c] = mmidx_clip8(sums[r]);
            }
        }
    }
}

#endif
