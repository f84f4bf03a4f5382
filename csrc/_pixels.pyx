"""Decoded uint8 RGB pixels → PIL's bicubic resize → normalised float32, straight into batch buffers.

One fused pass per image: the resize reproduces Pillow's ``Image.resize(size, BICUBIC)`` bit for
bit (``libImaging/Resample.c``: bicubic a = -0.5 with its support widened by the downscale factor,
coefficients normalised to sum 1 and rounded to 22-bit fixed point, the horizontal pass first into
8-bit rows, then the vertical pass, each rounded and clipped to 8 bits; a pass whose size does not
change is skipped, as Pillow skips it). Each output row is looked up at once in the caller's
(3, 256) table, which holds exactly what torchvision's ``ToTensor`` + ``Normalize`` compute for
each level, and written as float32 into a (3, H, W) slot of ``padded_images`` or as patch rows of
``packed_vit_tokens``. No intermediate image exists beyond the horizontal pass's 8-bit rows.

The vertical pass runs over whole rows (one multiply-add per tap and value, which the compiler
vectorises) instead of Pillow's column-by-column loop; integer sums are exact, so the order does
not change the result.
"""

from libc.math cimport ceil
from libc.stdint cimport int32_t, uint8_t
from libc.stdlib cimport free, malloc

cdef extern from "_pixels_rows.h":
    enum: MMIDX_BLOCK
    void mmidx_accumulate_row(int32_t* sums, const uint8_t* row, int32_t weight, Py_ssize_t count) noexcept nogil
    void mmidx_horizontal_block(const uint8_t* pixels, Py_ssize_t row_stride, Py_ssize_t pixel_stride,
                                Py_ssize_t in_width, Py_ssize_t rows, const Py_ssize_t* bounds,
                                const int32_t* weights, Py_ssize_t ksize, Py_ssize_t width, uint8_t* out,
                                Py_ssize_t out_stride, uint8_t* scratch) noexcept nogil

DEF PRECISION_BITS = 22          # Pillow: 32 - 8 bits of result - 2 bits of overshoot headroom
DEF HALF = 1 << (PRECISION_BITS - 1)


cdef inline double _bicubic(double x) noexcept nogil:
    """Pillow's bicubic kernel with a = -0.5, in its operation order."""
    if x < 0.0:
        x = -x
    if x < 1.0:
        return (1.5 * x - 2.5) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * -0.5
    return 0.0


cdef inline uint8_t _clip8(int32_t value) noexcept nogil:
    """A fixed-point sum → its 8-bit value, rounded down (the sums start at one half) and clipped."""
    value = value >> PRECISION_BITS
    if value < 0:
        return 0
    if value > 255:
        return 255
    return <uint8_t>value


cdef Py_ssize_t _coefficients(Py_ssize_t in_size, Py_ssize_t out_size, int32_t** weights,
                              Py_ssize_t** bounds) noexcept nogil:
    """Pillow's ``precompute_coeffs`` + ``normalize_coeffs_8bpc`` for a whole-image box.

    Returns the taps per output (``ksize``), or 0 if memory ran out; ``bounds`` holds (first input,
    count) per output and ``weights`` ``ksize`` fixed-point weights per output.
    """
    cdef double scale = <double>(<float>in_size) / out_size   # Pillow's box is float
    cdef double filterscale = scale if scale > 1.0 else 1.0
    cdef double support = 2.0 * filterscale, center, total, inverse = 1.0 / filterscale
    cdef Py_ssize_t ksize = <Py_ssize_t>ceil(support) * 2 + 1, out, x, first, count
    cdef double* k = <double*>malloc(ksize * sizeof(double))
    weights[0] = <int32_t*>malloc(out_size * ksize * sizeof(int32_t))
    bounds[0] = <Py_ssize_t*>malloc(out_size * 2 * sizeof(Py_ssize_t))
    if k == NULL or weights[0] == NULL or bounds[0] == NULL:
        free(k)
        return 0
    for out in range(out_size):
        center = (out + 0.5) * scale
        first = <int>(center - support + 0.5)      # C truncation, as Pillow's (int) cast
        if first < 0:
            first = 0
        count = <int>(center + support + 0.5)
        if count > in_size:
            count = in_size
        count -= first
        total = 0.0
        for x in range(count):
            k[x] = _bicubic((<double>(x + first) - center + 0.5) * inverse)
            total += k[x]
        for x in range(ksize):
            if x < count and total != 0.0:
                k[x] /= total
            elif x >= count:
                k[x] = 0.0
            if k[x] < 0:
                weights[0][out * ksize + x] = <int32_t>(-0.5 + k[x] * (1 << PRECISION_BITS))
            else:
                weights[0][out * ksize + x] = <int32_t>(0.5 + k[x] * (1 << PRECISION_BITS))
        bounds[0][2 * out] = first
        bounds[0][2 * out + 1] = count
    free(k)
    return ksize


cdef void _emit(const uint8_t* row, Py_ssize_t pixel_stride, Py_ssize_t y, Py_ssize_t width,
                const float* table, float* chw, Py_ssize_t plane, Py_ssize_t line,
                float* patches, Py_ssize_t patch) noexcept nogil:
    """Normalised output row ``y`` (``width`` RGB pixels at ``row``) into the CHW view or the patch rows."""
    cdef Py_ssize_t x, q, c, columns, patch_values
    cdef float* target
    cdef const uint8_t* pixel
    if chw != NULL:
        for c in range(3):
            target = chw + c * plane + y * line
            for x in range(width):
                target[x] = table[c * 256 + row[x * pixel_stride + c]]
    else:
        columns = width // patch
        patch_values = patch * patch * 3
        # Patch (y // patch, q), its pixel row y % patch: patch·3 consecutive values per patch.
        target = patches + (y // patch) * columns * patch_values + (y % patch) * patch * 3
        for q in range(columns):
            for x in range(patch):
                pixel = row + (q * patch + x) * pixel_stride
                for c in range(3):
                    target[q * patch_values + x * 3 + c] = table[c * 256 + pixel[c]]


cdef void _horizontal_row(const uint8_t* line, Py_ssize_t pixel_stride, Py_ssize_t width,
                          const Py_ssize_t* bounds, const int32_t* weights, Py_ssize_t ksize,
                          uint8_t* out) noexcept nogil:
    """One row's horizontal pass: ``width`` RGB pixels into ``out`` (3 bytes per pixel)."""
    cdef Py_ssize_t x, t, i, start, count
    cdef const int32_t* k
    cdef int32_t s0, s1, s2
    for x in range(width):
        start, count, k = bounds[2 * x], bounds[2 * x + 1], weights + x * ksize
        s0 = s1 = s2 = HALF
        for t in range(count):
            i = (start + t) * pixel_stride
            s0 += line[i] * k[t]
            s1 += line[i + 1] * k[t]
            s2 += line[i + 2] * k[t]
        out[3 * x], out[3 * x + 1], out[3 * x + 2] = _clip8(s0), _clip8(s1), _clip8(s2)


cdef void _vertical_row(const uint8_t* rows, Py_ssize_t row_stride, Py_ssize_t pixel_stride, Py_ssize_t width,
                        Py_ssize_t start, Py_ssize_t count, const int32_t* k, int32_t* sums,
                        uint8_t* out) noexcept nogil:
    """One output row of the vertical pass over rows start..start+count-1 (whole rows at a time)."""
    cdef Py_ssize_t t, x, i, values = 3 * width
    cdef const uint8_t* line
    cdef int32_t weight
    for i in range(values):
        sums[i] = HALF
    for t in range(count):
        line, weight = rows + (start + t) * row_stride, k[t]
        if pixel_stride == 3:
            mmidx_accumulate_row(sums, line, weight, values)
        else:
            for x in range(width):
                sums[3 * x] += line[x * pixel_stride] * weight
                sums[3 * x + 1] += line[x * pixel_stride + 1] * weight
                sums[3 * x + 2] += line[x * pixel_stride + 2] * weight
    for i in range(values):
        out[i] = _clip8(sums[i])


cdef int _render(const uint8_t* pixels, Py_ssize_t in_height, Py_ssize_t in_width, Py_ssize_t row_stride,
                 Py_ssize_t pixel_stride, Py_ssize_t height, Py_ssize_t width, bint vertical_first,
                 const float* table, float* chw, Py_ssize_t plane, Py_ssize_t line,
                 float* patches, Py_ssize_t patch) noexcept nogil:
    """Resize (in_height, in_width) → (height, width) as Pillow does and emit every row; -1 if out of memory.

    Pillow runs the horizontal pass first over the rows the vertical pass reads, unless
    ``vertical_first`` (Pillow 13: when both passes run and the height shrinks by more than twice
    the pixels the width loses); then each output row is a vertical row followed by its horizontal pass.
    """
    cdef bint horizontal = width != in_width, vertical = height != in_height
    cdef int32_t* kv = NULL
    cdef int32_t* kh = NULL
    cdef Py_ssize_t* bv = NULL
    cdef Py_ssize_t* bh = NULL
    cdef uint8_t* rows = NULL          # the horizontal pass's rows (horizontal pass first)
    cdef uint8_t* scratch = NULL       # MMIDX_BLOCK input rows interleaved for that pass
    cdef uint8_t* middle = NULL        # one vertical row before its horizontal pass (vertical first)
    cdef uint8_t* row8 = NULL          # one output row
    cdef int32_t* sums = NULL
    cdef Py_ssize_t ksv = 1, ksh = 1, first = 0, last = in_height, y, widest = max(width, in_width)
    cdef bint failed = False
    vertical_first = vertical_first and horizontal and vertical
    if vertical:
        ksv = _coefficients(in_height, height, &kv, &bv)
        failed = ksv == 0
        if not failed:
            first, last = bv[0], bv[2 * height - 2] + bv[2 * height - 1]   # the rows the vertical pass reads
    if horizontal:
        ksh = _coefficients(in_width, width, &kh, &bh)
        failed = failed or ksh == 0
    sums = <int32_t*>malloc(widest * 3 * sizeof(int32_t))
    row8 = <uint8_t*>malloc(width * 3)
    if vertical_first:
        middle = <uint8_t*>malloc(in_width * 3)
        failed = failed or middle == NULL
    elif horizontal:
        rows = <uint8_t*>malloc((last - first) * width * 3)
        scratch = <uint8_t*>malloc(in_width * 3 * MMIDX_BLOCK)
        failed = failed or rows == NULL or scratch == NULL
    failed = failed or sums == NULL or row8 == NULL
    if not failed:
        if horizontal and not vertical_first:     # the horizontal pass, MMIDX_BLOCK rows at a time
            y = 0
            while y < last - first:
                mmidx_horizontal_block(pixels + (y + first) * row_stride, row_stride, pixel_stride, in_width,
                                       min(<Py_ssize_t>MMIDX_BLOCK, last - first - y), bh, kh, ksh, width,
                                       rows + y * width * 3, width * 3, scratch)
                y += MMIDX_BLOCK
        for y in range(height):
            if vertical_first:
                _vertical_row(pixels, row_stride, pixel_stride, in_width, bv[2 * y], bv[2 * y + 1], kv + y * ksv,
                              sums, middle)
                _horizontal_row(middle, 3, width, bh, kh, ksh, row8)
            elif horizontal and vertical:
                _vertical_row(rows, width * 3, 3, width, bv[2 * y] - first, bv[2 * y + 1], kv + y * ksv, sums, row8)
            elif vertical:
                _vertical_row(pixels, row_stride, pixel_stride, width, bv[2 * y], bv[2 * y + 1], kv + y * ksv,
                              sums, row8)
            elif horizontal:
                _emit(rows + y * width * 3, 3, y, width, table, chw, plane, line, patches, patch)
                continue
            if vertical or horizontal:
                _emit(row8, 3, y, width, table, chw, plane, line, patches, patch)
            else:
                _emit(pixels + y * row_stride, pixel_stride, y, width, table, chw, plane, line, patches, patch)
    free(kv)
    free(bv)
    free(kh)
    free(bh)
    free(rows)
    free(scratch)
    free(middle)
    free(row8)
    free(sums)
    return -1 if failed else 0


cdef const uint8_t* _source(const uint8_t[:, :, :] pixels, Py_ssize_t* row_stride,
                            Py_ssize_t* pixel_stride) except NULL:
    if pixels.shape[2] != 3 or pixels.strides[2] != 1 or pixels.shape[0] < 1 or pixels.shape[1] < 1:
        raise ValueError(f"pixels must be a non-empty (H, W, 3) uint8 array with adjacent channels, "
                         f"got shape {tuple(pixels.shape)[:3]} and strides {tuple(pixels.strides)[:3]}")
    row_stride[0], pixel_stride[0] = pixels.strides[0], pixels.strides[1]
    return &pixels[0, 0, 0]


cdef const float* _table(const float[:, ::1] table) except NULL:
    if table.shape[0] != 3 or table.shape[1] != 256:
        raise ValueError("table must be (3, 256) float32")
    return &table[0, 0]


def render_chw(const uint8_t[:, :, :] pixels, float[:, :, :] out, const float[:, ::1] table,
               bint vertical_first):
    """out[c, y, x] = table[c, v] for v the (H, W, 3) ``pixels`` bicubic-resized as Pillow does to
    out's (h, w) (not resized if equal): a (3, h, w) view whose rows are contiguous."""
    cdef Py_ssize_t row_stride, pixel_stride
    cdef const uint8_t* source = _source(pixels, &row_stride, &pixel_stride)
    cdef const float* levels = _table(table)
    cdef Py_ssize_t height = out.shape[1], width = out.shape[2]
    if out.shape[0] != 3 or height < 1 or width < 1 or out.strides[2] != sizeof(float):
        raise ValueError(f"out must be a non-empty (3, h, w) float32 view with contiguous rows, got shape "
                         f"{tuple(out.shape)[:3]} and strides {tuple(out.strides)[:3]}")
    cdef int status
    with nogil:
        status = _render(source, pixels.shape[0], pixels.shape[1], row_stride, pixel_stride, height, width,
                         vertical_first, levels, &out[0, 0, 0], out.strides[0] // sizeof(float), out.strides[1] // sizeof(float),
                         NULL, 0)
    if status:
        raise MemoryError(f"resizing {pixels.shape[1]}x{pixels.shape[0]} to {width}x{height}")


def render_patches(const uint8_t[:, :, :] pixels, float[:, ::1] out, const float[:, ::1] table,
                   Py_ssize_t height, Py_ssize_t width, Py_ssize_t patch, bint vertical_first):
    """BAGEL's ``patchify`` of the normalised ``pixels`` bicubic-resized as Pillow does to (height, width),
    into the rows of ``out``: one row per patch (row-major), each flattened as (patch row, column, channel)."""
    cdef Py_ssize_t row_stride, pixel_stride
    cdef const uint8_t* source = _source(pixels, &row_stride, &pixel_stride)
    cdef const float* levels = _table(table)
    if patch < 1 or height < patch or width < patch or height % patch or width % patch:
        raise ValueError(f"an image of {height}x{width} does not divide into {patch}x{patch} patches")
    cdef Py_ssize_t count = (height // patch) * (width // patch)
    if out.shape[0] != count or out.shape[1] != patch * patch * 3:
        raise ValueError(f"out must be ({count}, {patch * patch * 3}), got {tuple(out.shape)[:2]}")
    cdef int status
    with nogil:
        status = _render(source, pixels.shape[0], pixels.shape[1], row_stride, pixel_stride, height, width,
                         vertical_first, levels, NULL, 0, 0, &out[0, 0], patch)
    if status:
        raise MemoryError(f"resizing {pixels.shape[1]}x{pixels.shape[0]} to {width}x{height}")
