"""The O(n) structure check of a dataset's index arrays in one pass of C (``mmidx.read.invariants``).

``structure_sound`` answers whether every invariant ``structure_problems`` checks holds: the token index's
lengths, pointers and document indices, and the plan's offsets, element records, image records and sample
origins. It reads each array once, allocates nothing, and keeps every index it forms inside the array it
indexes (the offsets are checked to be ordered and to end where the next array does before they are followed),
so corrupted files give ``False``, never a read outside the maps. Only a dataset that fails is rescanned by the
vectorised checks, which say what is wrong. The index arrays start at byte 34 of the ``.idx`` file, so values
are loaded with ``memcpy`` (a plain unaligned load), as ``_reader.pyx`` does.
"""

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint16_t, uint64_t
from libc.string cimport memcpy

from mmidx.format import ELEMENT_DTYPE, IMAGE_DTYPE, IMAGE_FORMATS, IMAGE_MODES, KIND_NAMES, KNOWN_FLAGS, TEXT

cnp.import_array()

if [ELEMENT_DTYPE.fields[name][1] for name in ("kind", "flags", "img_num", "payload")] != [0, 1, 2, 12] \
        or ELEMENT_DTYPE.itemsize != 16:
    raise ImportError(f"mmidx.format's ELEMENT_DTYPE {ELEMENT_DTYPE}: _structure reads kind, flags, img_num and "
                      "payload at bytes 0, 1, 2 and 12 of 16")
if [IMAGE_DTYPE.fields[name][1] for name in ("width", "height", "format", "mode")] != [0, 4, 8, 9] \
        or IMAGE_DTYPE.itemsize != 12:
    raise ImportError(f"mmidx.format's IMAGE_DTYPE {IMAGE_DTYPE}: _structure reads width, height, format and mode "
                      "at bytes 0, 4, 8 and 9 of 12")


include "_unaligned.pxi"


cdef const char* _data(cnp.ndarray array, object dtype, int64_t length, str name) except NULL:
    """The array's data, once it is checked to be ``length`` contiguous items of ``dtype``."""
    if array.dtype != dtype or not array.flags.c_contiguous or array.shape[0] != length:
        raise ValueError(f"{name}: expected {length} contiguous items of {dtype}, got {array.shape[0]} of "
                         f"{array.dtype}")
    return <const char*>cnp.PyArray_DATA(array) if length else <const char*>""


cdef bint _ordered(const char* offsets, int64_t count, int64_t last) noexcept nogil:
    """Whether ``count + 1`` offsets start at 0, never decrease and end at ``last``."""
    cdef int64_t i
    if _load_i64(offsets, 0) != 0 or _load_i64(offsets, count) != last:
        return False
    for i in range(count):
        if _load_i64(offsets, i + 1) < _load_i64(offsets, i):
            return False
    return True


def tokens_sound(cnp.ndarray lengths, cnp.ndarray pointers, cnp.ndarray document_indices, int itemsize) -> bool:
    """Whether no sequence length is negative, every pointer is the cumulative length before it times
    ``itemsize`` (in wrapping 64-bit arithmetic, as numpy's cumsum), and the document indices never decrease."""
    cdef int64_t n = lengths.shape[0], documents = document_indices.shape[0], i
    cdef const char* length = _data(lengths, np.dtype("<i4"), n, "sequence_lengths")
    cdef const char* pointer = _data(pointers, np.dtype("<i8"), n, "sequence_pointers")
    cdef const char* document = _data(document_indices, np.dtype("<i8"), documents, "document_indices")
    cdef uint64_t total = 0
    cdef int32_t size
    cdef bint sound = True
    with nogil:
        for i in range(n):
            size = _load_i32(length, i)
            if size < 0 or <uint64_t>_load_i64(pointer, i) != total:
                sound = False
                break
            total += <uint64_t>size * <uint64_t>itemsize
        for i in range(documents - 1):
            if _load_i64(document, i + 1) < _load_i64(document, i):
                sound = False
                break
    return sound


def plan_sound(cnp.ndarray document_indices, dict plan, int64_t sources) -> bool:
    """Whether the plan's offsets are ordered and end where the arrays they index end, every sample has a
    view, every element has a known kind and flags, an img_num of at least 1 and a payload naming one of
    its sample's texts (for text elements) or images, every image has a positive size and known format
    and mode codes, and every sample's origin is -1 or one of the ``sources`` recorded files.

    ``document_indices`` must already be sound (:func:`tokens_sound`): they give each sample's texts."""
    cdef cnp.ndarray view_offsets = plan["sample_view_offsets"], image_offsets = plan["sample_image_offsets"]
    cdef cnp.ndarray element_offsets = plan["view_element_offsets"], elements = plan["elements"]
    cdef cnp.ndarray info = plan["image_info"], origin = plan["sample_origin"]
    cdef int64_t samples = document_indices.shape[0] - 1
    cdef int64_t views = element_offsets.shape[0] - 1, images = info.shape[0], count = elements.shape[0]
    i8 = np.dtype("<i8")
    cdef const char* document = _data(document_indices, i8, samples + 1, "document_indices")
    cdef const char* sample_views = _data(view_offsets, i8, samples + 1, "sample_view_offsets")
    cdef const char* sample_images = _data(image_offsets, i8, samples + 1, "sample_image_offsets")
    cdef const char* view_elements = _data(element_offsets, i8, views + 1, "view_element_offsets")
    cdef const char* element = _data(elements, ELEMENT_DTYPE, count, "elements")
    cdef const char* image = _data(info, IMAGE_DTYPE, images, "image_info")
    if origin.ndim != 2 or origin.shape[1] != 2:
        raise ValueError(f"sample_origin: expected shape ({samples}, 2), got {(<object>origin).shape}")
    cdef const char* origins = _data(origin, i8, samples, "sample_origin")
    for name in ("image_offsets", "sample_extra_offsets"):
        if name in plan:
            offsets = plan[name]
            if len(offsets) == 0 or not _ordered(_data(offsets, i8, len(offsets), name), len(offsets) - 1,
                                                      offsets[len(offsets) - 1]):
                return False
    cdef int64_t kinds = len(KIND_NAMES), formats = len(IMAGE_FORMATS), modes = len(IMAGE_MODES)
    cdef unsigned char unknown_flags = <unsigned char>(~KNOWN_FLAGS & 0xFF), text = TEXT
    cdef int64_t s, v, e, texts, pictures, first_view, end_view, source
    cdef const char* record
    cdef int32_t payload
    cdef uint16_t img_num
    cdef bint sound = True
    if not (_ordered(sample_views, samples, views) and _ordered(sample_images, samples, images)
            and _ordered(view_elements, views, count)):
        return False
    with nogil:
        for s in range(samples):
            first_view, end_view = _load_i64(sample_views, s), _load_i64(sample_views, s + 1)
            source = _load_i64(origins, 2 * s)
            if first_view == end_view or source < -1 or source >= sources:
                sound = False
                break
            texts = _load_i64(document, s + 1) - _load_i64(document, s)
            pictures = _load_i64(sample_images, s + 1) - _load_i64(sample_images, s)
            for v in range(first_view, end_view):
                for e in range(_load_i64(view_elements, v), _load_i64(view_elements, v + 1)):
                    record = element + 16 * e
                    memcpy(&img_num, record + 2, 2)
                    payload = _load_i32(record + 12, 0)
                    if (<unsigned char>record[0] >= kinds or <unsigned char>record[1] & unknown_flags or img_num < 1
                            or payload < 0 or payload >= (texts if <unsigned char>record[0] == text else pictures)):
                        sound = False
                        break
                if not sound:
                    break
            if not sound:
                break
        if sound:
            for e in range(images):
                record = image + 12 * e
                if (_load_i32(record, 0) <= 0 or _load_i32(record, 1) <= 0 or <unsigned char>record[8] >= formats
                        or <unsigned char>record[9] >= modes):
                    sound = False
                    break
    return sound
