# Loads of int64 / int32 item i of a mapped file's bytes, which need not be aligned: memcpy compiles to a
# plain unaligned load and never traps. Included by the kernels that read index arrays in place.

cdef inline int64_t _load_i64(const char* base, int64_t i) noexcept nogil:
    cdef int64_t value
    memcpy(&value, base + 8 * i, 8)
    return value


cdef inline int32_t _load_i32(const char* base, int64_t i) noexcept nogil:
    cdef int32_t value
    memcpy(&value, base + 4 * i, 4)
    return value
