"""Zero-copy random access to a Megatron MMIDIDX token stream (``P.idx`` + ``P.bin``).

The index arrays start at byte 34 of the ``.idx`` file and so are not naturally aligned; the
kernels here load them with ``memcpy``, which compiles to a plain unaligned load and never traps.
Every pointer read from a file is checked against the size of the mapped ``.bin`` before it is
dereferenced, so a corrupted index raises ``FormatError`` instead of reading outside the map.
"""

import os

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE, PyBuffer_FillInfo, PyObject_CheckBuffer
from libc cimport errno as cerrno
from posix.mman cimport MAP_FAILED, MAP_SHARED, PROT_READ, mmap, munmap
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t
from libc.string cimport memcpy

cdef extern from "Python.h":
    Py_ssize_t PY_SSIZE_T_MAX

from mmidx.format import IMAGE_FLAG_TRANSPARENCY, IMAGE_FORMATS, IMAGE_MODES, FormatError

cnp.import_array()


include "_unaligned.pxi"


cdef class FileMap:
    """A file mapped read-only into memory, exposed through the buffer protocol; unmapped when the last view of
    it is released.

    Python's ``mmap.mmap`` keeps a duplicate of the file's descriptor open for as long as the map lives, so a
    process with a few thousand datasets mapped (a sharded dataset's shards, a data config of many datasets) ran
    out of file descriptors ("Too many open files" at ``ulimit -n 1024``). This map closes the descriptor as soon
    as the file is mapped: a mapped file costs one memory map and no descriptor.
    """

    cdef void* _address
    cdef Py_ssize_t _size
    cdef readonly object path

    def __cinit__(self, path):
        self._address = NULL
        self._size = 0
        self.path = path
        cdef int fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        cdef void* address
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                return
            if size > PY_SSIZE_T_MAX:
                raise OSError(f"{path}: {size} bytes cannot be mapped by this process")
            address = mmap(NULL, <size_t>size, PROT_READ, MAP_SHARED, fd, 0)
            if address == MAP_FAILED:
                error = cerrno.errno
                raise OSError(error, f"cannot map {path}: {os.strerror(error)}")
            self._address, self._size = address, size
        finally:
            os.close(fd)

    def __len__(self):
        return self._size

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError(f"{self.path} is mapped read-only")
        PyBuffer_FillInfo(buffer, self, self._address, self._size, 1, flags)

    def __releasebuffer__(self, Py_buffer* buffer):
        pass

    def __dealloc__(self):
        if self._address != NULL:
            munmap(self._address, <size_t>self._size)


def map_readonly(path):
    """A read-only memoryview of the whole file at ``path`` (memory-mapped by :class:`FileMap`, which holds no
    file descriptor; empty files allowed).

    The memoryview is the base object of every array handed out, so the mapping lives as long as
    any view of it and cannot be closed under a reader's feet.
    """
    return memoryview(FileMap(os.fspath(path)))


cdef class TokenStream:
    """Token ids of a Megatron MMIDIDX pair, read by sequence number without copying.

    Built from the mapped files and their parsed header (``mmidx.format.read_token_index_header``);
    checks in O(1) that the index describes exactly the ``.bin`` file it is paired with. ``bin_view``
    may instead be a byte source without the buffer protocol (an object in storage,
    :class:`mmidx.storage.RemoteFile`): ``len()`` its size, ``source[a:b]`` exactly bytes [a, b); every
    check is the same, only the checked spans are then read through it instead of from a map.
    """

    cdef readonly object path_prefix
    cdef readonly object dtype
    cdef readonly int64_t sequence_count
    cdef readonly int64_t document_count
    cdef readonly bint multimodal
    cdef object _idx_view
    cdef object _bin_view
    cdef const char* _lengths
    cdef const char* _pointers
    cdef const char* _documents
    cdef const char* _bin
    cdef int64_t _bin_size
    cdef bint _ranged
    cdef int _itemsize
    cdef int _typenum
    cdef object _header

    def __cinit__(self, path_prefix, header, idx_view, bin_view):
        cdef const unsigned char[::1] idx_bytes = idx_view
        cdef const unsigned char[::1] bin_bytes
        self.path_prefix = path_prefix
        self._header = header
        self.dtype = header.dtype
        self.sequence_count = header.sequence_count
        self.document_count = header.document_count - 1
        self.multimodal = header.multimodal
        self._idx_view = idx_view
        self._bin_view = bin_view
        if len(idx_view) != header.file_size:
            raise FormatError(f"{path_prefix}.idx: mapped {len(idx_view)} bytes, header needs {header.file_size}")
        cdef const char* base = <const char*>&idx_bytes[0]
        cdef Py_ssize_t lengths_offset = header.lengths_offset
        cdef Py_ssize_t pointers_offset = header.pointers_offset
        cdef Py_ssize_t documents_offset = header.documents_offset
        self._lengths = base + lengths_offset
        self._pointers = base + pointers_offset
        self._documents = base + documents_offset
        self._ranged = not PyObject_CheckBuffer(bin_view)
        self._bin = NULL
        if not self._ranged:
            bin_bytes = bin_view
            if len(bin_view):
                self._bin = <const char*>&bin_bytes[0]
        self._bin_size = len(bin_view)
        self._itemsize = self.dtype.itemsize
        self._typenum = self.dtype.num
        self._check_extent()

    cdef _check_extent(self):
        cdef int64_t n = self.sequence_count
        cdef int64_t first_doc = _load_i64(self._documents, 0)
        cdef int64_t last_doc = _load_i64(self._documents, self.document_count)
        if first_doc != 0 or last_doc != n:
            raise FormatError(f"{self.path_prefix}.idx: document indices run from {first_doc} to {last_doc}, "
                              f"expected 0 to {n} (the sequence count): corrupted index")
        if n == 0:
            if self._bin_size != 0:
                raise FormatError(f"{self.path_prefix}.bin: {self._bin_size} bytes but the index has no sequences")
            return
        cdef int64_t first = _load_i64(self._pointers, 0)
        cdef int64_t last = _load_i64(self._pointers, n - 1)
        cdef int64_t last_size = _load_i32(self._lengths, n - 1)
        if first != 0:
            raise FormatError(f"{self.path_prefix}.idx: the first sequence pointer is {first}, not 0: corrupted index")
        # Compared, never added: the last pointer comes from the file and may be anything.
        if last < 0 or last > self._bin_size or last_size < 0 or last_size * self._itemsize != self._bin_size - last:
            raise FormatError(f"{self.path_prefix}.bin: size {self._bin_size} bytes, but the index says the last "
                              f"sequence ({last_size} tokens) starts at byte {last}: the .bin is truncated, or "
                              "does not belong to this .idx")

    def __len__(self):
        return self.sequence_count

    @property
    def sequence_lengths(self):
        """int32 tokens per sequence (a view of the index file)."""
        return np.frombuffer(self._idx_view, "<i4", self.sequence_count, self._header.lengths_offset)

    @property
    def sequence_pointers(self):
        """int64 byte offset of each sequence in the ``.bin`` file (a view of the index file)."""
        return np.frombuffer(self._idx_view, "<i8", self.sequence_count, self._header.pointers_offset)

    @property
    def document_indices(self):
        """int64 sequence ranges of documents: document d is sequences [di[d], di[d+1])."""
        return np.frombuffer(self._idx_view, "<i8", self.document_count + 1, self._header.documents_offset)

    @property
    def sequence_modes(self):
        """int8 mode per sequence in Megatron multimodal files, else None."""
        if not self.multimodal:
            return None
        return np.frombuffer(self._idx_view, "i1", self.sequence_count, self._header.modes_offset)

    @property
    def token_count(self):
        """The number of tokens the ``.bin`` file holds."""
        return self._bin_size // self._itemsize

    @property
    def tokens(self):
        """All tokens of the stream as one flat read-only array (a view of the ``.bin`` file)."""
        if self._ranged:
            raise TypeError(f"{self.path_prefix}.bin is read by byte range: use get() or gather()")
        return np.frombuffer(self._bin_view, self.dtype)

    cdef object _exact(self, int64_t start, int64_t size):
        """Bytes [start, start + size) from the byte source, refused unless exactly that many came."""
        data = self._bin_view[start:start + size]
        if len(data) != size:
            raise FormatError(f"{self.path_prefix}.bin: asked bytes [{start}, {start + size}), got {len(data)}: "
                              "the object is shorter than the metadata says")
        return data

    cdef cnp.ndarray _view(self, int64_t byte_offset, int64_t count):
        if self._ranged:  # a checked span, read through the byte source
            fetched = np.frombuffer(self._exact(byte_offset, count * self._itemsize), self.dtype)
            fetched.flags.writeable = False
            return fetched
        cdef cnp.npy_intp dims[1]
        dims[0] = count
        cdef cnp.ndarray array = cnp.PyArray_SimpleNewFromData(
            1, dims, self._typenum, <void*>(self._bin + byte_offset) if count else <void*>self._bin)
        cnp.PyArray_CLEARFLAGS(array, cnp.NPY_ARRAY_WRITEABLE)
        Py_INCREF(self._bin_view)
        cnp.PyArray_SetBaseObject(array, self._bin_view)
        return array

    cdef inline int64_t _span_start(self, int64_t sequence, int64_t offset, int64_t count) noexcept nogil:
        """Byte offset of tokens [offset, offset + count) of ``sequence`` in the .bin, or -1 when its
        pointer puts them outside the file. Overflow-proof: 0 <= offset, count <= 2^31, so only the
        pointer, read from the file, can be anything, and it is compared, never added, to the size."""
        cdef int64_t pointer = _load_i64(self._pointers, sequence)
        if pointer < 0 or pointer > self._bin_size or pointer % self._itemsize:
            return -1
        if offset + count > (self._bin_size - pointer) // self._itemsize:
            return -1
        return pointer + offset * self._itemsize

    cpdef cnp.ndarray get(self, int64_t sequence, int64_t offset=0, object length=None):
        """Tokens ``[offset, offset + length)`` of one sequence, as a read-only zero-copy view.

        Unlike Megatron's ``IndexedDataset.get``, every argument is bounds-checked: a sequence
        number outside ``[-len, len)`` or a span outside the sequence raises ``IndexError``.
        """
        cdef int64_t n = self.sequence_count
        if sequence < 0:
            sequence += n
        if sequence < 0 or sequence >= n:
            raise IndexError(f"sequence {sequence} out of range for {n} sequences")
        return self._checked_view(sequence, offset, -1 if length is None else <int64_t>length,
                                  length is None)

    cdef cnp.ndarray _checked_view(self, int64_t sequence, int64_t offset, int64_t length, bint whole):
        """``get`` for a sequence number already known to be in range."""
        cdef int64_t size = _load_i32(self._lengths, sequence)
        if size < 0:
            raise FormatError(f"{self.path_prefix}.idx: sequence {sequence} has a negative length ({size}): "
                              "corrupted index")
        if offset < 0 or offset > size:
            raise IndexError(f"offset {offset} out of range for sequence {sequence} of {size} tokens")
        cdef int64_t count = size - offset if whole else length
        if count < 0 or count > size - offset:
            raise IndexError(f"tokens [{offset}, {offset} + {count}) out of range for sequence {sequence} "
                             f"of {size} tokens")
        cdef int64_t start = self._span_start(sequence, offset, count)
        if start < 0:
            raise FormatError(f"{self.path_prefix}.idx: pointer of sequence {sequence} "
                              f"({_load_i64(self._pointers, sequence)}) lies outside the .bin file "
                              f"({self._bin_size} bytes) or is not a multiple of the token size: corrupted index")
        return self._view(start, count)

    cpdef tuple document_range(self, int64_t document):
        """Sequences ``[start, end)`` of ``document`` (0 <= document < document_count), checked to be
        an ordered range of existing sequences before anything is read with them."""
        if document < 0 or document >= self.document_count:
            raise IndexError(f"document {document} out of range for {self.document_count} documents")
        cdef int64_t start = _load_i64(self._documents, document)
        cdef int64_t end = _load_i64(self._documents, document + 1)
        if not (0 <= start <= end <= self.sequence_count):
            raise self._document_error(document, start, end)
        return start, end

    cdef object _document_error(self, int64_t document, int64_t start, int64_t end):
        return FormatError(f"{self.path_prefix}.idx: document_indices[{document}:{document + 2}] = "
                           f"[{start}, {end}] is not a range inside [0, {self.sequence_count}] "
                           f"(sample {document}): corrupted")

    def document_text(self, int64_t document, int64_t j):
        """Tokens of sequence ``j`` of ``document`` (a sample's text ``j``) as a zero-copy view."""
        if document < 0 or document >= self.document_count:
            self.document_range(document)  # raises the IndexError
        cdef int64_t start = _load_i64(self._documents, document), end = _load_i64(self._documents, document + 1)
        if not (0 <= start <= end <= self.sequence_count):
            raise self._document_error(document, start, end)
        if j < 0 or j >= end - start:
            raise IndexError(f"text {j} out of range: sample {document} has {end - start} texts")
        return self._checked_view(start + j, 0, -1, True)

    def document_texts(self, int64_t document):
        """Tokens of every sequence of ``document`` as zero-copy views."""
        cdef int64_t start, end, sequence
        start, end = self.document_range(document)
        return [self._checked_view(sequence, 0, -1, True) for sequence in range(start, end)]

    def gather(self, sequences, offsets=None, lengths=None):
        """Copy many sequence spans into one contiguous array in a single call.

        ``sequences``: sequence numbers; ``offsets``/``lengths`` (optional, same length): the span
        of each to take (default: whole sequences). Returns ``(tokens, bounds)`` where span i is
        ``tokens[bounds[i]:bounds[i + 1]]``. Raises ``IndexError`` for any span out of range.
        """
        cdef int64_t[::1] seq = np.ascontiguousarray(sequences, dtype=np.int64).reshape(-1)
        cdef Py_ssize_t count = seq.shape[0], i
        cdef bint whole = lengths is None
        cdef int64_t[::1] off = np.zeros(count, np.int64) if offsets is None else \
            np.ascontiguousarray(offsets, dtype=np.int64).reshape(-1)
        cdef int64_t[::1] lens = off if whole else np.ascontiguousarray(lengths, dtype=np.int64).reshape(-1)
        if off.shape[0] != count or lens.shape[0] != count:
            raise ValueError(f"offsets and lengths must have one entry per sequence ({count})")
        bounds_array = np.empty(count + 1, dtype=np.int64)
        cdef int64_t[::1] bounds = bounds_array
        cdef int64_t[::1] starts = np.empty(count, dtype=np.int64)
        cdef int64_t n = self.sequence_count, s = 0, size = 0, start, take, total = 0
        cdef Py_ssize_t bad = -1
        cdef int reason = 0  # 1: sequence out of range, 2: span out of range, 3: pointer outside .bin,
        # 4: negative length
        cdef int itemsize = self._itemsize
        with nogil:
            bounds[0] = 0
            for i in range(count):
                s = seq[i]
                if s < 0 or s >= n:
                    bad, reason = i, 1
                    break
                size = _load_i32(self._lengths, s)
                if size < 0:
                    bad, reason = i, 4
                    break
                take = size - off[i] if whole else lens[i]
                if off[i] < 0 or off[i] > size or take < 0 or take > size - off[i]:
                    bad, reason = i, 2
                    break
                start = self._span_start(s, off[i], take)
                if start < 0:
                    bad, reason = i, 3
                    break
                starts[i] = start
                total += take
                bounds[i + 1] = total
        if reason == 1:
            raise IndexError(f"sequence {s} (entry {bad}) out of range for {n} sequences")
        if reason == 2:
            raise IndexError(f"span of entry {bad} (offset {off[bad]}) out of range for sequence {s} "
                             f"of {size} tokens")
        if reason == 3:
            raise FormatError(f"{self.path_prefix}.idx: pointer of sequence {s} ({_load_i64(self._pointers, s)}) "
                              f"lies outside the .bin file ({self._bin_size} bytes) or is not a multiple "
                              "of the token size: corrupted index")
        if reason == 4:
            raise FormatError(f"{self.path_prefix}.idx: sequence {s} has a negative length ({size}): corrupted index")
        out = np.empty(total, dtype=self.dtype)
        cdef char* dst = <char*>cnp.PyArray_DATA(out)
        cdef const unsigned char[::1] chunk
        if self._ranged:  # checked spans, read through the byte source
            for i in range(count):
                take = bounds[i + 1] - bounds[i]
                if take:
                    chunk = self._exact(starts[i], take * itemsize)
                    memcpy(dst + bounds[i] * itemsize, &chunk[0], take * itemsize)
            return out, bounds_array
        with nogil:
            for i in range(count):
                take = bounds[i + 1] - bounds[i]
                if take:
                    memcpy(dst + bounds[i] * itemsize, self._bin + starts[i], take * itemsize)
        return out, bounds_array

    def __reduce__(self):
        raise TypeError("TokenStream holds memory maps; pickle the dataset that owns it (it re-maps lazily)")


cdef inline const char* _data_of(cnp.ndarray array, object dtype, str name) except NULL:
    if array.dtype != dtype or not array.flags.c_contiguous:
        raise TypeError(f"{name} must be a contiguous {dtype} array")
    return <const char*>cnp.PyArray_DATA(array)


cdef class ImageTable:
    """The images of a multimodal dataset by (sample, number): checked reads of ``P.plan``'s image
    arrays, in C, that hand out records of zero-copy views of ``P.images``.

    Every offset is read from the file and checked to be an ordered range inside what it indexes
    before it is used, exactly as ``Sample`` checks it, so corrupted offsets are a ``FormatError``.
    """

    cdef object _prefix, _record, _formats, _modes, _data, _arrays
    cdef const char* _sample_offsets
    cdef const char* _offsets
    cdef const char* _info
    cdef int64_t _samples, _images, _data_size, _format_count, _mode_count
    cdef unsigned char _transparency

    def __cinit__(self, prefix, cnp.ndarray sample_image_offsets, cnp.ndarray image_offsets,
                  cnp.ndarray image_info, data, record):
        i8 = np.dtype("<i8")
        self._sample_offsets = _data_of(sample_image_offsets, i8, "sample_image_offsets")
        self._offsets = _data_of(image_offsets, i8, "image_offsets")
        if image_info.dtype.itemsize != 12 or [image_info.dtype.fields[name][1] for name in
                                               ("width", "height", "format", "mode", "flags")] != [0, 4, 8, 9, 10]:
            raise TypeError("image_info must have the layout of IMAGE_DTYPE")
        self._info = _data_of(image_info, image_info.dtype, "image_info")
        self._arrays = (sample_image_offsets, image_offsets, image_info)  # keeps the pointers valid
        self._samples = len(sample_image_offsets) - 1
        self._images = len(image_info)
        if len(image_offsets) != self._images + 1:
            raise FormatError(f"{prefix}.plan: image_offsets has {len(image_offsets)} entries, "
                              f"image_info {self._images}: corrupted")
        self._prefix, self._data, self._data_size = prefix, data, len(data)
        self._transparency = IMAGE_FLAG_TRANSPARENCY
        self._record, self._formats, self._modes = record, IMAGE_FORMATS, IMAGE_MODES
        self._format_count, self._mode_count = len(IMAGE_FORMATS), len(IMAGE_MODES)
        if not (isinstance(record, type) and issubclass(record, tuple)):
            raise TypeError("record must be a tuple type (a NamedTuple of the six fields of image())")

    cdef tuple _range(self, const char* offsets, str name, int64_t number, int64_t limit, int64_t sample):
        cdef int64_t start = _load_i64(offsets, number), end = _load_i64(offsets, number + 1)
        if not (0 <= start <= end <= limit):
            raise self._range_error(name, number, start, end, limit, sample)
        return start, end

    cdef object _range_error(self, str name, int64_t number, int64_t start, int64_t end, int64_t limit,
                             int64_t sample):
        return FormatError(f"{self._prefix}.plan: {name}[{number}:{number + 2}] = [{start}, {end}] is "
                           f"not a range inside [0, {limit}] (sample {sample}): corrupted")

    def count(self, int64_t sample):
        """The number of images of ``sample``."""
        if sample < 0 or sample >= self._samples:
            raise IndexError(f"sample {sample} out of range for {self._samples} samples")
        start, end = self._range(self._sample_offsets, "sample_image_offsets", sample, self._images, sample)
        return end - start

    def image(self, int64_t sample, int64_t j):
        """Image ``j`` of ``sample`` as a record: (bytes view, width, height, format, mode, has_transparency)."""
        if sample < 0 or sample >= self._samples:
            raise IndexError(f"sample {sample} out of range for {self._samples} samples")
        cdef int64_t first = _load_i64(self._sample_offsets, sample), last = _load_i64(self._sample_offsets, sample + 1)
        if not (0 <= first <= last <= self._images):
            raise self._range_error("sample_image_offsets", sample, first, last, self._images, sample)
        if j < 0 or j >= last - first:
            raise IndexError(f"image {j} out of range: sample {sample} has {last - first} images")
        cdef int64_t number = first + j
        cdef int64_t start = _load_i64(self._offsets, number), end = _load_i64(self._offsets, number + 1)
        if not (0 <= start <= end <= self._data_size):
            raise self._range_error("image_offsets", number, start, end, self._data_size, sample)
        cdef const char* info = self._info + 12 * number
        cdef int32_t width = _load_i32(info, 0), height = _load_i32(info, 1)
        cdef unsigned char format_code = <unsigned char>info[8], mode_code = <unsigned char>info[9]
        if width <= 0 or height <= 0:
            raise FormatError(f"{self._prefix}.plan: image {number} (sample {sample}) has a size of "
                              f"{width}x{height} in image_info: corrupted")
        # tuple.__new__ builds the NamedTuple without running its Python-level __new__ (a third of the call).
        return tuple.__new__(self._record, (self._data[start:end], width, height,
                             self._formats[format_code] if format_code < self._format_count else "unknown",
                             self._modes[mode_code] if mode_code < self._mode_count else "unknown",
                             (<unsigned char>info[10] & self._transparency) != 0))
