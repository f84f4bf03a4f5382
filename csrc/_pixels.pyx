"""Decoded uint8 RGB pixels → PIL's bicubic resize → normalised float32, straight into batch buffers.

One fused pass per image: the resize reproduces Pillow's ``Image.resize(size, BICUBIC)`` bit for
bit (``libImaging/Resample.c``: bicubic a = -0.5 with its support widened by the downscale factor,
coefficients normalised to sum 1 and rounded to 22-bit fixed point, the horizontal pass first into
8-bit rows, then the vertical pass, each rounded and clipped to 8 bits; a pass whose size does not
change is skipped, as Pillow skips it). Each output row is looked up at once in the caller's
(3, 256) table, which holds exactly what torchvision's ``ToTensor`` + ``Normalize`` compute for
each level, and written as float32 into a (3, H, W) slot of ``padded_images``, or, for
``packed_vit_tokens``, gathered into the 8-bit rows of one row of patches and written patch by patch,
each patch's values one sequential run (writing each image row's 42 values into every patch, with a
normalise call each, took 1.7x as long on a 504² image that is not resized). No intermediate image exists
beyond the horizontal pass's 8-bit rows and that band of patch rows.

The two passes run in one of four kernels, all giving the same bytes: portable C
(``_pixels_rows.h``, "scalar") and SSE4.1 / AVX2 intrinsics (``_pixels_simd.h``: two AVX2 kernels, multiplying
whole weights with pmulld or split ones with pmaddwd and pmaddubsw, whichever is faster on the CPU; they also compute the
normalised values instead of looking them up, ``_pixels_normalize.h``, where that reproduces every level of
the table bit for bit, checked before each image), the fastest the CPU runs chosen at import;
``set_kernel`` forces one (tests run every Pillow comparison on each, benchmarks/bench_resample.py times them). The vertical pass runs over whole rows instead of Pillow's
column-by-column loop, the horizontal pass over 8 rows at once; integer sums are exact, so the order
does not change the result. Each pass's coefficients are computed once per pair of sizes and kept (``_Filter``:
a corpus's images mostly share a few sizes; 512² photos to BAGEL's 518² ViT size spent 2% of their resize on
them).
"""

from libc.math cimport ceil
from libc.stdint cimport int32_t, uint8_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

cdef extern from "_pixels_simd.h":
    enum: MMIDX_BLOCK
    enum: MMIDX_KERNELS
    ctypedef void (*mmidx_vertical_fn)(const uint8_t* rows, Py_ssize_t row_stride, Py_ssize_t count,
                                       const int32_t* k, Py_ssize_t values, uint8_t* out) noexcept nogil
    ctypedef void (*mmidx_horizontal_fn)(const uint8_t* pixels, Py_ssize_t row_stride, Py_ssize_t pixel_stride,
                                         Py_ssize_t in_width, Py_ssize_t rows, const Py_ssize_t* bounds,
                                         const int32_t* weights, Py_ssize_t ksize,
                                         Py_ssize_t width, uint8_t* out, Py_ssize_t out_stride,
                                         uint8_t* scratch) noexcept nogil
    ctypedef Py_ssize_t (*mmidx_planes_fn)(const uint8_t* row, Py_ssize_t pixel_stride, Py_ssize_t width,
                                           const float* norm, float* r, float* g, float* b) noexcept nogil
    ctypedef void (*mmidx_values_fn)(const uint8_t* values, Py_ssize_t stride, Py_ssize_t count, Py_ssize_t runs,
                                     const float* norm, float* out) noexcept nogil
    ctypedef struct mmidx_kernel:
        const char* name
        mmidx_vertical_fn vertical
        mmidx_horizontal_fn horizontal
        mmidx_planes_fn planes
        mmidx_values_fn values
        int pairs
        int whole
    const mmidx_kernel mmidx_kernels[]
    int mmidx_kernel_supported(int i) noexcept nogil
    int mmidx_default_kernel() noexcept nogil
    int mmidx_split_pairs(const int32_t* k, Py_ssize_t n, Py_ssize_t ksize, int32_t* pairs) noexcept nogil

DEF PRECISION_BITS = 22          # Pillow: 32 - 8 bits of result - 2 bits of overshoot headroom


cdef inline double _bicubic(double x) noexcept nogil:
    """Pillow's bicubic kernel with a = -0.5, in its operation order."""
    if x < 0.0:
        x = -x
    if x < 1.0:
        return (1.5 * x - 2.5) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * -0.5
    return 0.0


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


cdef int32_t* _pairs(const int32_t* weights, Py_ssize_t outputs, Py_ssize_t ksize) noexcept nogil:
    """``weights`` (``ksize`` per output) split into madd pairs (``mmidx_split_pairs``: an even number per
    output), or NULL if memory ran out or a weight is out of the split's range."""
    cdef int32_t* pairs = <int32_t*>malloc(outputs * ((ksize + 1) // 2 * 2) * sizeof(int32_t))
    if pairs != NULL and not mmidx_split_pairs(weights, outputs, ksize, pairs):
        free(pairs)
        return NULL
    return pairs


cdef struct _Pass:
    const Py_ssize_t* bounds     # (first input, count) per output
    const int32_t* weights       # ksize whole weights per output
    const int32_t* pairs         # the same split into madd pairs (an even number per output), or NULL
    Py_ssize_t ksize


cdef class _Filter:
    """One pass's coefficients for ``in_size`` → ``out_size`` (``_coefficients``) and their madd pairs (``_pairs``),
    computed once per pair of sizes and kept (``_filter``): every image of the same size takes the same ones."""
    cdef _Pass c
    cdef int32_t* weights
    cdef Py_ssize_t* bounds
    cdef int32_t* pairs

    def __cinit__(self, Py_ssize_t in_size, Py_ssize_t out_size):
        cdef Py_ssize_t ksize = _coefficients(in_size, out_size, &self.weights, &self.bounds)
        if ksize == 0:
            raise MemoryError(f"resize coefficients for {in_size} -> {out_size}")
        self.pairs = _pairs(self.weights, out_size, ksize)
        self.c.bounds, self.c.weights, self.c.pairs, self.c.ksize = self.bounds, self.weights, self.pairs, ksize

    def __dealloc__(self):
        free(self.weights)
        free(self.bounds)
        free(self.pairs)


cdef dict _filters = {}
DEF FILTERS = 256                # sizes kept: a corpus of many sizes recomputes, one of few never does


cdef _Filter _filter(Py_ssize_t in_size, Py_ssize_t out_size):
    """The ``_Filter`` of ``in_size`` → ``out_size`` from the cache (the oldest of ``FILTERS`` evicted first), or
    None where the size is kept (no pass). The caller holds it for the call: the cache may let it go meanwhile."""
    if in_size == out_size:
        return None
    key = (in_size, out_size)
    found = _filters.get(key)
    if found is None:
        if len(_filters) >= FILTERS:
            del _filters[next(iter(_filters))]
        found = _filters[key] = _Filter(in_size, out_size)
    return found


cdef _Pass _pass(_Filter filter):
    """``filter``'s coefficients for ``_render``; none (None) where the pass keeps the size."""
    cdef _Pass none
    if filter is None:
        none.bounds, none.weights, none.pairs, none.ksize = NULL, NULL, NULL, 1
        return none
    return filter.c


cdef bint _levels_match(const mmidx_kernel* kernel, const float* table, const float* norm) noexcept nogil:
    """Whether the kernel's normalise step gives ``table``'s bits for every level of every channel, through
    both of its layouts (CHW planes, pixel-major values): then it may replace looking the table up."""
    cdef uint8_t levels[768]
    cdef float planes[768]
    cdef float values[768]
    cdef Py_ssize_t v, c
    for v in range(768):
        levels[v] = <uint8_t>(v // 3)          # pixel v // 3 is grey level v // 3
    if kernel.planes(levels, 3, 256, norm, planes, planes + 256, planes + 512) != 256:
        return False
    kernel.values(levels, 768, 768, 1, norm, values)
    for v in range(256):
        for c in range(3):
            if memcmp(&values[3 * v + c], &table[c * 256 + v], sizeof(float)):
                return False
    return memcmp(planes, table, sizeof(planes)) == 0


cdef const float* _computed(const mmidx_kernel* kernel, const float* table, const float* norm) noexcept nogil:
    """``norm`` where the kernel computes ``table``'s values from it (``_levels_match``), else NULL: look them up."""
    if norm != NULL and kernel.planes != NULL and _levels_match(kernel, table, norm):
        return norm
    return NULL


cdef void _emit(const uint8_t* row, Py_ssize_t pixel_stride, Py_ssize_t y, Py_ssize_t width,
                const float* table, const mmidx_kernel* kernel, const float* norm, float* chw, Py_ssize_t plane,
                Py_ssize_t line, float* patches, Py_ssize_t patch, uint8_t* band) noexcept nogil:
    """Normalised output row ``y`` (``width`` RGB pixels at ``row``) into the CHW view, or into ``band`` (the
    ``patch`` 8-bit RGB rows of one row of patches) whose patches are emitted once its last row is in: by the
    kernel's normalise step where ``norm`` is given (``_levels_match``), else looked up in ``table``."""
    cdef Py_ssize_t x, c, done = 0
    cdef float* target
    cdef uint8_t* to
    if chw != NULL:
        if norm != NULL:
            target = chw + y * line
            done = kernel.planes(row, pixel_stride, width, norm, target, target + plane, target + 2 * plane)
        for c in range(3):
            target = chw + c * plane + y * line
            for x in range(done, width):
                target[x] = table[c * 256 + row[x * pixel_stride + c]]
        return
    to = band + (y % patch) * width * 3
    if row == to:
        pass                           # the vertical pass wrote it there
    elif pixel_stride == 3:
        memcpy(to, row, width * 3)
    else:
        for x in range(width):
            memcpy(to + x * 3, row + x * pixel_stride, 3)
    if y % patch == patch - 1:
        _emit_patches(band, width, table, kernel, norm, patches + (y // patch) * (width // patch) * patch * patch * 3,
                      patch)


cdef void _emit_patches(const uint8_t* band, Py_ssize_t width, const float* table, const mmidx_kernel* kernel,
                        const float* norm, float* out, Py_ssize_t patch) noexcept nogil:
    """One row of patches from its ``patch`` 8-bit RGB rows ``band``, each patch's values written in order
    (patch row, column, channel) to the next patch·patch·3 floats of ``out``: one sequential pass."""
    cdef Py_ssize_t q, r, x, line = width * 3, run = patch * 3
    cdef const uint8_t* pixel
    for q in range(width // patch):
        if norm != NULL and run >= 8:
            kernel.values(band + q * run, line, run, patch, norm, out)
        else:
            for r in range(patch):
                pixel = band + r * line + q * run
                for x in range(run):
                    out[r * run + x] = table[(x % 3) * 256 + pixel[x]]
        out += patch * run


cdef int _render(const uint8_t* pixels, Py_ssize_t in_height, Py_ssize_t in_width, Py_ssize_t row_stride,
                 Py_ssize_t pixel_stride, Py_ssize_t height, Py_ssize_t width, bint vertical_first,
                 const _Pass* pv, const _Pass* ph, const float* table, const float* norm, float* chw,
                 Py_ssize_t plane, Py_ssize_t line, float* patches, Py_ssize_t patch) noexcept nogil:
    """Resize (in_height, in_width) → (height, width) as Pillow does and emit every row; -1 if out of memory.

    Pillow runs the horizontal pass first over the rows the vertical pass reads, unless
    ``vertical_first`` (Pillow 13: when both passes run and the height shrinks by more than twice
    the pixels the width loses); then MMIDX_BLOCK vertical rows at a time go through the horizontal
    pass. The vertical pass keeps its input's layout (``pixel_stride`` 3 or 4 bytes per pixel).
    """
    cdef const mmidx_kernel* kernel = _kernel     # read once: set_kernel may run meanwhile
    cdef bint horizontal = width != in_width, vertical = height != in_height
    cdef const int32_t* kv = NULL
    cdef const int32_t* kh = NULL
    cdef const Py_ssize_t* bv = pv.bounds
    cdef const Py_ssize_t* bh = ph.bounds
    cdef uint8_t* rows = NULL          # the horizontal pass's rows (all, or one block if vertical first)
    cdef uint8_t* scratch = NULL       # MMIDX_BLOCK input rows interleaved for that pass
    cdef uint8_t* middle = NULL        # MMIDX_BLOCK vertical rows before their horizontal pass (vertical first)
    cdef uint8_t* row8 = NULL          # one output row of the vertical pass
    cdef uint8_t* band = NULL          # the output rows of one row of patches (patches only)
    cdef uint8_t* target8
    cdef Py_ssize_t ksv = pv.ksize, ksh = ph.ksize, first = 0, last = in_height, y, r, n, out_line = width * 3
    cdef Py_ssize_t in_line = in_width * pixel_stride, in_span = (in_width - 1) * pixel_stride + 3
    cdef bint failed = False
    vertical_first = vertical_first and horizontal and vertical
    norm = _computed(kernel, table, norm)
    if kernel.pairs and (not vertical or pv.pairs != NULL) and (not horizontal or ph.pairs != NULL):
        kv, kh = pv.pairs, ph.pairs    # both passes' weights split, or both whole
        ksv, ksh = (ksv + 1) // 2 * 2, (ksh + 1) // 2 * 2
    else:
        kernel = &mmidx_kernels[kernel.whole] if kernel.pairs else kernel
        kv, kh = pv.weights, ph.weights
    if vertical:
        first, last = bv[0], bv[2 * height - 2] + bv[2 * height - 1]   # the rows the vertical pass reads
    if horizontal:
        scratch = <uint8_t*>malloc((in_width + 2) * 4 * MMIDX_BLOCK)     # room for a pair's tap past the last
        if vertical_first:
            middle = <uint8_t*>malloc(in_line * MMIDX_BLOCK)
            rows = <uint8_t*>malloc(out_line * MMIDX_BLOCK)
            failed = middle == NULL
        else:
            rows = <uint8_t*>malloc((last - first) * out_line)
        failed = failed or rows == NULL or scratch == NULL
    row8 = <uint8_t*>malloc(width * pixel_stride)
    failed = failed or row8 == NULL
    if patches != NULL:
        band = <uint8_t*>malloc(patch * width * 3)
        failed = failed or band == NULL
    if not failed and vertical_first:
        y = 0
        while y < height:
            n = min(<Py_ssize_t>MMIDX_BLOCK, height - y)
            for r in range(y, y + n):
                kernel.vertical(pixels + bv[2 * r] * row_stride, row_stride, bv[2 * r + 1], kv + r * ksv, in_span,
                                middle + (r - y) * in_line)
            kernel.horizontal(middle, in_line, pixel_stride, in_width, n, bh, kh, ksh, width, rows, out_line,
                              scratch)
            for r in range(n):
                _emit(rows + r * out_line, 3, y + r, width, table, kernel, norm, chw, plane, line, patches, patch, band)
            y += MMIDX_BLOCK
    elif not failed:
        y = 0
        while horizontal and y < last - first:     # the horizontal pass, MMIDX_BLOCK rows at a time
            kernel.horizontal(pixels + (y + first) * row_stride, row_stride, pixel_stride, in_width,
                              min(<Py_ssize_t>MMIDX_BLOCK, last - first - y), bh, kh, ksh, width,
                              rows + y * out_line, out_line, scratch)
            y += MMIDX_BLOCK
        for y in range(height):
            if horizontal and vertical:       # 3-byte rows: patches' go straight into their band
                target8 = row8 if band == NULL else band + (y % patch) * out_line
                kernel.vertical(rows + (bv[2 * y] - first) * out_line, out_line, bv[2 * y + 1], kv + y * ksv,
                                out_line, target8)
                _emit(target8, 3, y, width, table, kernel, norm, chw, plane, line, patches, patch, band)
            elif vertical:
                kernel.vertical(pixels + bv[2 * y] * row_stride, row_stride, bv[2 * y + 1], kv + y * ksv,
                                in_span, row8)
                _emit(row8, pixel_stride, y, width, table, kernel, norm, chw, plane, line, patches, patch, band)
            elif horizontal:
                _emit(rows + y * out_line, 3, y, width, table, kernel, norm, chw, plane, line, patches, patch, band)
            else:
                _emit(pixels + y * row_stride, pixel_stride, y, width, table, kernel, norm, chw, plane, line, patches, patch, band)
    free(rows)
    free(scratch)
    free(middle)
    free(row8)
    free(band)
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


cdef const float* _norm(const float[:, ::1] normalization) except? NULL:
    if normalization is None:
        return NULL
    if normalization.shape[0] != 2 or normalization.shape[1] != 3:
        raise ValueError("normalization must be (2, 3) float32: the mean, then the std, of R, G and B")
    return &normalization[0, 0]


def render_chw(const uint8_t[:, :, :] pixels, float[:, :, :] out, const float[:, ::1] table,
               bint vertical_first, const float[:, ::1] normalization=None):
    """out[c, y, x] = table[c, v] for v the (H, W, 3) ``pixels`` bicubic-resized as Pillow does to
    out's (h, w) (not resized if equal): a (3, h, w) view whose rows are contiguous.

    ``normalization`` (the float32 mean and std the table was computed from, as rows) lets the kernel
    compute the values instead of looking them up, where it has a normalise step that reproduces every
    level of ``table`` bit for bit (checked on each call); the result is the table's either way."""
    if pixels.strides[1] not in (3, 4):
        pixels = pixels.copy()        # the kernels read RGB or RGBX pixels (3 or 4 bytes apart)
    cdef Py_ssize_t row_stride, pixel_stride
    cdef const uint8_t* source = _source(pixels, &row_stride, &pixel_stride)
    cdef const float* levels = _table(table)
    cdef const float* norm = _norm(normalization)
    cdef Py_ssize_t height = out.shape[1], width = out.shape[2]
    if out.shape[0] != 3 or height < 1 or width < 1 or out.strides[2] != sizeof(float):
        raise ValueError(f"out must be a non-empty (3, h, w) float32 view with contiguous rows, got shape "
                         f"{tuple(out.shape)[:3]} and strides {tuple(out.strides)[:3]}")
    cdef int status
    cdef _Filter fv = _filter(pixels.shape[0], height), fh = _filter(pixels.shape[1], width)
    cdef _Pass pv = _pass(fv), ph = _pass(fh)
    with nogil:
        status = _render(source, pixels.shape[0], pixels.shape[1], row_stride, pixel_stride, height, width,
                         vertical_first, &pv, &ph, levels, norm, &out[0, 0, 0], out.strides[0] // sizeof(float),
                         out.strides[1] // sizeof(float), NULL, 0)
    if status:
        raise MemoryError(f"resizing {pixels.shape[1]}x{pixels.shape[0]} to {width}x{height}")


def render_patches(const uint8_t[:, :, :] pixels, float[:, ::1] out, const float[:, ::1] table,
                   Py_ssize_t height, Py_ssize_t width, Py_ssize_t patch, bint vertical_first,
                   const float[:, ::1] normalization=None):
    """BAGEL's ``patchify`` of the normalised ``pixels`` bicubic-resized as Pillow does to (height, width),
    into the rows of ``out``: one row per patch (row-major), each flattened as (patch row, column, channel).
    ``normalization`` as in ``render_chw``."""
    if pixels.strides[1] not in (3, 4):
        pixels = pixels.copy()        # the kernels read RGB or RGBX pixels (3 or 4 bytes apart)
    cdef Py_ssize_t row_stride, pixel_stride
    cdef const uint8_t* source = _source(pixels, &row_stride, &pixel_stride)
    cdef const float* levels = _table(table)
    cdef const float* norm = _norm(normalization)
    if patch < 1 or height < patch or width < patch or height % patch or width % patch:
        raise ValueError(f"an image of {height}x{width} does not divide into {patch}x{patch} patches")
    cdef Py_ssize_t count = (height // patch) * (width // patch)
    if out.shape[0] != count or out.shape[1] != patch * patch * 3:
        raise ValueError(f"out must be ({count}, {patch * patch * 3}), got {tuple(out.shape)[:2]}")
    cdef int status
    cdef _Filter fv = _filter(pixels.shape[0], height), fh = _filter(pixels.shape[1], width)
    cdef _Pass pv = _pass(fv), ph = _pass(fh)
    with nogil:
        status = _render(source, pixels.shape[0], pixels.shape[1], row_stride, pixel_stride, height, width,
                         vertical_first, &pv, &ph, levels, norm, NULL, 0, 0, &out[0, 0], patch)
    if status:
        raise MemoryError(f"resizing {pixels.shape[1]}x{pixels.shape[0]} to {width}x{height}")


cdef const mmidx_kernel* _kernel = &mmidx_kernels[0]


def computes_levels(const float[:, ::1] table, const float[:, ::1] normalization) -> bool:
    """Whether the kernel in use computes ``table``'s values from ``normalization`` (its vectorised
    normalise step reproduces every level bit for bit) rather than looking them up: True for BAGEL's
    tables on an AVX2 CPU. Either way ``render_chw`` and ``render_patches`` write the table's values."""
    cdef const float* levels = _table(table)
    cdef const float* norm = _norm(normalization)
    return _computed(_kernel, levels, norm) != NULL


def available_kernels() -> tuple:
    """The names of the resize kernels this CPU runs: ``"scalar"`` (portable C, everywhere), ``"sse4"`` (x86-64
    with SSE4.1), ``"avx2"`` and ``"avx2-madd"`` (AVX2, multiplying whole weights with pmulld or split ones with
    pmaddwd and pmaddubsw: which is faster depends on the CPU; ``kernel()`` names the one chosen). All give the
    same, Pillow's, bytes."""
    return tuple(mmidx_kernels[i].name.decode() for i in range(MMIDX_KERNELS) if mmidx_kernel_supported(i))


def kernel() -> str:
    """The name of the resize kernel in use: the fastest on this CPU (``mmidx_default_kernel`` in
    ``_pixels_simd.h``), unless ``set_kernel`` chose another."""
    return _kernel.name.decode()


def set_kernel(name: str) -> None:
    """Use the resize kernel ``name`` (one of ``available_kernels()``) in this process from now on: for
    tests of every kernel and benchmarks of one against another. Raises ValueError for any other name."""
    global _kernel
    cdef int i
    for i in range(MMIDX_KERNELS):
        if mmidx_kernels[i].name.decode() == name and mmidx_kernel_supported(i):
            _kernel = &mmidx_kernels[i]
            return
    raise ValueError(f"no resize kernel {name!r} on this CPU; available: {', '.join(available_kernels())}")


_kernel = &mmidx_kernels[mmidx_default_kernel()]   # the fastest this CPU runs
