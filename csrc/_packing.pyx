"""Kernel of mmidx's multimodal packing (the rules are stated in ``mmidx.index.pack_samples``).

One pass over the stream, without the GIL. The deferral buffer is a treap keyed by
(token count ascending, stream position descending), so "the largest buffered item that fits in
``room`` tokens" (earliest arrival among equal counts) is one O(log B) descent, and insertions and
removals are O(log B); its node priorities are a hash of the stream position, so its shape, like
everything else here, is a pure function of the inputs. Mandatory groups keep one cursor each over
their own positions, which only moves forward: O(n) over the whole stream. Total O(n log B).
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memmove


cdef enum:
    PENDING = 0
    PLACED = 1
    BUFFERED = 2
    EXCLUDED = 3


cdef struct Buffer:
    int64_t* count
    int64_t* position
    int64_t* deferred_at  # packs emitted when the item entered the buffer
    uint64_t* priority
    int64_t* left
    int64_t* right
    int64_t root
    int64_t free_list  # unused nodes, chained through ``left``
    int64_t size


cdef struct Packer:
    const int64_t* counts
    uint8_t* state
    int64_t max_num_tokens
    int64_t expected_num_tokens
    int64_t prefer_buffer_before
    int64_t max_buffer_size
    int64_t num_mandatory
    int64_t* mandatory_offsets  # positions of mandatory group m: [offsets[m], offsets[m + 1])
    int64_t* mandatory_positions
    int64_t* cursor
    Buffer buffer
    int64_t* pack_items
    int64_t* pack_offsets
    int64_t* pack_tokens
    int64_t num_items
    int64_t num_packs
    int64_t pack_sum
    int64_t deferred
    int64_t max_deferral
    int64_t solo_packs


cdef inline uint64_t _mix(uint64_t x) noexcept nogil:
    """splitmix64's finaliser: well-spread treap priorities from stream positions."""
    x += 0x9E3779B97F4A7C15ULL
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline bint _before(Buffer* b, int64_t node, int64_t count, int64_t position) noexcept nogil:
    """Whether ``node`` sorts before the key (count, position)."""
    return b.count[node] < count or (b.count[node] == count and b.position[node] > position)


cdef void _split(Buffer* b, int64_t node, int64_t count, int64_t position,
                 int64_t* low, int64_t* high) noexcept nogil:
    """Split the subtree at ``node`` into keys before (count, position) and the rest."""
    if node < 0:
        low[0] = -1
        high[0] = -1
    elif _before(b, node, count, position):
        _split(b, b.right[node], count, position, &b.right[node], high)
        low[0] = node
    else:
        _split(b, b.left[node], count, position, low, &b.left[node])
        high[0] = node


cdef int64_t _merge(Buffer* b, int64_t low, int64_t high) noexcept nogil:
    """Join two subtrees whose keys are all ordered low < high."""
    if low < 0:
        return high
    if high < 0:
        return low
    if b.priority[low] > b.priority[high]:
        b.right[low] = _merge(b, b.right[low], high)
        return low
    b.left[high] = _merge(b, low, b.left[high])
    return high


cdef void _buffer_insert(Buffer* b, int64_t count, int64_t position, int64_t deferred_at) noexcept nogil:
    cdef int64_t node = b.free_list, low, high
    b.free_list = b.left[node]
    b.count[node] = count
    b.position[node] = position
    b.deferred_at[node] = deferred_at
    b.priority[node] = _mix(<uint64_t> position)
    b.left[node] = -1
    b.right[node] = -1
    _split(b, b.root, count, position, &low, &high)
    b.root = _merge(b, _merge(b, low, node), high)
    b.size += 1


cdef int64_t _erase(Buffer* b, int64_t node, int64_t count, int64_t position) noexcept nogil:
    """Remove the key (count, position) from the subtree at ``node``; returns the new subtree."""
    cdef int64_t joined
    if b.position[node] == position:
        joined = _merge(b, b.left[node], b.right[node])
        b.left[node] = b.free_list
        b.free_list = node
        b.size -= 1
        return joined
    if _before(b, node, count, position):
        b.right[node] = _erase(b, b.right[node], count, position)
    else:
        b.left[node] = _erase(b, b.left[node], count, position)
    return node


cdef int64_t _find(Buffer* b, int64_t count, int64_t position) noexcept nogil:
    """The node holding the key (count, position), which must be buffered."""
    cdef int64_t node = b.root
    while b.position[node] != position:
        node = b.right[node] if _before(b, node, count, position) else b.left[node]
    return node


cdef int64_t _largest_fitting(Buffer* b, int64_t room) noexcept nogil:
    """The node of the largest count <= room (earliest arrival among equals), or -1."""
    cdef int64_t node = b.root, best = -1
    while node >= 0:
        if b.count[node] <= room:
            best = node
            node = b.right[node]
        else:
            node = b.left[node]
    return best


cdef inline void _place(Packer* p, int64_t position) noexcept nogil:
    p.pack_items[p.num_items] = position
    p.num_items += 1
    p.pack_sum += p.counts[position]
    p.state[position] = PLACED


cdef void _take_from_buffer(Packer* p, int64_t node) noexcept nogil:
    """Place a buffered item into the open pack and drop it from the buffer."""
    cdef int64_t position = p.buffer.position[node]
    p.max_deferral = max(p.max_deferral, p.num_packs - p.buffer.deferred_at[node])
    p.buffer.root = _erase(&p.buffer, p.buffer.root, p.buffer.count[node], position)
    _place(p, position)


cdef inline void _close(Packer* p) noexcept nogil:
    """Emit the open pack, if it holds anything."""
    if p.num_items > p.pack_offsets[p.num_packs]:
        p.pack_tokens[p.num_packs] = p.pack_sum
        p.num_packs += 1
        p.pack_offsets[p.num_packs] = p.num_items
        p.pack_sum = 0


cdef void _place_mandatory(Packer* p) noexcept nogil:
    """One item of each mandatory group, in group order: the group's earliest unconsumed one."""
    cdef int64_t m, position, candidate
    for m in range(p.num_mandatory):
        position = -1
        while p.cursor[m] < p.mandatory_offsets[m + 1]:
            candidate = p.mandatory_positions[p.cursor[m]]
            if p.state[candidate] == PENDING or p.state[candidate] == BUFFERED:
                position = candidate
                break
            p.cursor[m] += 1
        if position < 0:
            continue  # the group is exhausted
        if p.pack_sum + p.counts[position] > p.max_num_tokens:
            continue  # stays first in line for the next pack
        if p.state[position] == BUFFERED:
            _take_from_buffer(p, _find(&p.buffer, p.counts[position], position))
        else:
            _place(p, position)
        p.cursor[m] += 1


cdef void _fill_from_buffer(Packer* p, int64_t below) noexcept nogil:
    """Add the largest buffered item that fits, again and again, while the pack holds fewer than
    ``below`` tokens."""
    cdef int64_t node
    while p.pack_sum < below and p.buffer.size > 0:
        node = _largest_fitting(&p.buffer, p.max_num_tokens - p.pack_sum)
        if node < 0:
            return
        _take_from_buffer(p, node)


cdef void _emit_solo(Packer* p) noexcept nogil:
    """Emit the largest buffered item as a pack of its own, ahead of the open pack (which so far
    holds only mandatory items, so shifting them by one slot is cheap)."""
    cdef int64_t start = p.pack_offsets[p.num_packs]
    cdef int64_t already = p.num_items - start
    cdef int64_t held = p.pack_sum
    cdef int64_t node = _largest_fitting(&p.buffer, p.max_num_tokens)
    memmove(&p.pack_items[start + 1], &p.pack_items[start], already * sizeof(int64_t))
    p.num_items = start
    p.pack_sum = 0
    _take_from_buffer(p, node)
    _close(p)
    p.num_items = start + 1 + already
    p.pack_sum = held
    p.solo_packs += 1


cdef void _open(Packer* p) noexcept nogil:
    """Start a pack: mandatory items, then the buffer (up to ``prefer_buffer_before`` tokens);
    keep the buffer bounded with a solo pack; close at once if that already reached expected."""
    while True:
        _place_mandatory(p)
        _fill_from_buffer(p, p.prefer_buffer_before)
        if p.buffer.size > p.max_buffer_size:
            _emit_solo(p)
        if p.pack_sum < p.expected_num_tokens:
            return
        _close(p)


def pack(const int64_t[::1] counts, const int32_t[::1] groups, const uint8_t[::1] mandatory,
         int64_t max_num_tokens, int64_t expected_num_tokens, int64_t max_num_tokens_per_sample,
         int64_t prefer_buffer_before, int64_t max_buffer_size,
         int64_t[::1] pack_items, int64_t[::1] pack_offsets, int64_t[::1] pack_tokens,
         int64_t[::1] excluded):
    """Pack the stream into the preallocated outputs (each of length n, ``pack_offsets`` n + 1).

    Returns (num_packs, num_items, num_excluded, deferred, max_deferral, solo_packs), or
    (-1, position) for the first position whose group id is outside ``mandatory`` or whose token
    count is negative.
    """
    cdef int64_t n = counts.shape[0]
    cdef int64_t num_groups = mandatory.shape[0]
    cdef int64_t capacity = min(max_buffer_size + 2, n + 1)
    cdef int64_t position, group, m, num_excluded = 0, bad = -1
    cdef int64_t node
    cdef Packer p
    cdef int64_t* slot = <int64_t*> malloc(max(num_groups, 1) * sizeof(int64_t))
    p.counts = &counts[0] if n > 0 else NULL
    p.state = <uint8_t*> malloc(max(n, 1))
    p.max_num_tokens = max_num_tokens
    p.expected_num_tokens = expected_num_tokens
    p.prefer_buffer_before = prefer_buffer_before
    p.max_buffer_size = max_buffer_size
    p.num_mandatory = 0
    p.mandatory_offsets = NULL
    p.mandatory_positions = <int64_t*> malloc(max(n, 1) * sizeof(int64_t))
    p.cursor = NULL
    p.buffer.count = <int64_t*> malloc(capacity * sizeof(int64_t))
    p.buffer.position = <int64_t*> malloc(capacity * sizeof(int64_t))
    p.buffer.deferred_at = <int64_t*> malloc(capacity * sizeof(int64_t))
    p.buffer.priority = <uint64_t*> malloc(capacity * sizeof(uint64_t))
    p.buffer.left = <int64_t*> malloc(capacity * sizeof(int64_t))
    p.buffer.right = <int64_t*> malloc(capacity * sizeof(int64_t))
    p.buffer.root = -1
    p.buffer.free_list = 0
    p.buffer.size = 0
    p.pack_items = &pack_items[0] if n > 0 else NULL
    p.pack_offsets = &pack_offsets[0]
    p.pack_tokens = &pack_tokens[0] if n > 0 else NULL
    p.num_items = 0
    p.num_packs = 0
    p.pack_sum = 0
    p.deferred = 0
    p.max_deferral = 0
    p.solo_packs = 0
    try:
        for group in range(num_groups):
            slot[group] = p.num_mandatory if mandatory[group] else -1
            p.num_mandatory += mandatory[group] != 0
        p.mandatory_offsets = <int64_t*> malloc((p.num_mandatory + 1) * sizeof(int64_t))
        p.cursor = <int64_t*> malloc(max(p.num_mandatory, 1) * sizeof(int64_t))
        if (slot == NULL or p.state == NULL or p.mandatory_positions == NULL
                or p.mandatory_offsets == NULL or p.cursor == NULL or p.buffer.count == NULL
                or p.buffer.position == NULL or p.buffer.deferred_at == NULL
                or p.buffer.priority == NULL or p.buffer.left == NULL or p.buffer.right == NULL):
            raise MemoryError()
        with nogil:
            for m in range(p.num_mandatory + 1):
                p.mandatory_offsets[m] = 0
            # Exclusions and validation, and the size of each mandatory group.
            for position in range(n):
                group = groups[position]
                if group < 0 or group >= num_groups or counts[position] < 0:
                    bad = position
                    break
                if counts[position] > max_num_tokens_per_sample:
                    p.state[position] = EXCLUDED
                    excluded[num_excluded] = position
                    num_excluded += 1
                else:
                    p.state[position] = PENDING
                    if slot[group] >= 0:
                        p.mandatory_offsets[slot[group] + 1] += 1
            if bad < 0:
                for m in range(p.num_mandatory):
                    p.mandatory_offsets[m + 1] += p.mandatory_offsets[m]
                    p.cursor[m] = p.mandatory_offsets[m]
                for position in range(n):
                    m = slot[groups[position]]
                    if m >= 0 and p.state[position] == PENDING:
                        p.mandatory_positions[p.cursor[m]] = position
                        p.cursor[m] += 1
                for m in range(p.num_mandatory):
                    p.cursor[m] = p.mandatory_offsets[m]
                for node in range(capacity):
                    p.buffer.left[node] = node + 1 if node + 1 < capacity else -1
                p.pack_offsets[0] = 0

                _open(&p)
                for position in range(n):
                    if p.state[position] != PENDING:
                        continue
                    if p.pack_sum + counts[position] <= max_num_tokens:
                        _place(&p, position)
                    else:
                        p.state[position] = BUFFERED
                        _buffer_insert(&p.buffer, counts[position], position, p.num_packs)
                        p.deferred += 1
                    if p.pack_sum >= expected_num_tokens or p.buffer.size > max_buffer_size:
                        _close(&p)
                        _open(&p)
                # The stream is spent: drain the buffer, each pack filled up to expected.
                _fill_from_buffer(&p, expected_num_tokens)
                _close(&p)
                while p.buffer.size > 0:
                    _place_mandatory(&p)
                    _fill_from_buffer(&p, expected_num_tokens)
                    _close(&p)
        if bad >= 0:
            return (-1, bad)
        return (p.num_packs, p.num_items, num_excluded, p.deferred, p.max_deferral, p.solo_packs)
    finally:
        free(slot)
        free(p.state)
        free(p.mandatory_offsets)
        free(p.mandatory_positions)
        free(p.cursor)
        free(p.buffer.count)
        free(p.buffer.position)
        free(p.buffer.deferred_at)
        free(p.buffer.priority)
        free(p.buffer.left)
        free(p.buffer.right)
