/* The two inner loops of the resize in csrc/_pixels.pyx, in C so that on x86-64 Linux they are
 * compiled twice (AVX2 and baseline) with the CPU choosing at load time: AVX2 multiplies eight int32
 * at once, where baseline SSE2 has no 32-bit vector multiply. Integer arithmetic throughout, so the
 * sums, and the pixels, are the same whichever version runs. */
#ifndef MMIDX_PIXELS_ROWS_H
#define MMIDX_PIXELS_ROWS_H

#include <stddef.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MMIDX_CLONES __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef MMIDX_CLONES
#define MMIDX_CLONES
#endif

#define MMIDX_PRECISION_BITS 22
#define MMIDX_BLOCK 8

static inline uint8_t mmidx_clip8(int32_t value) {
    value >>= MMIDX_PRECISION_BITS;
    return value < 0 ? 0 : value > 255 ? 255 : (uint8_t)value;
}

/* sums[i] += row[i] * weight: one input row's share of an output row of the vertical pass. */
MMIDX_CLONES
static void mmidx_accumulate_row(int32_t *restrict sums, const uint8_t *restrict row, int32_t weight,
                                 ptrdiff_t count) {
    for (ptrdiff_t i = 0; i < count; i++) {
        sums[i] += row[i] * weight;
    }
}

/* The horizontal pass of `rows` (at most MMIDX_BLOCK) consecutive RGB rows at once: the rows are
 * interleaved into `scratch` (in_width * 3 * MMIDX_BLOCK bytes) so that each tap is one 8-lane
 * multiply-add over the rows; output row r goes to out + r * out_stride (3 bytes per pixel). */
MMIDX_CLONES
static void mmidx_horizontal_block(const uint8_t *in, ptrdiff_t row_stride, ptrdiff_t pixel_stride,
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
                sums[r] = 1 << (MMIDX_PRECISION_BITS - 1);
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
