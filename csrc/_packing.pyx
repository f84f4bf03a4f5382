"""Kernel of mmidx's multimodal packing (the rules are stated in ``mmidx.index.pack_samples``).

A resumable packer: the stream is fed a chunk at a time (``feed``) and everything it needs to carry
over a chunk boundary lives in the ``Packer``: the deferral buffer, the open pack and, per mandatory
group, a queue of that group's items not yet reached by the stream (``lookahead``). A pack takes
its mandatory item from the group's earliest buffered item, else from the front of that queue, so a
rare mandatory group may run ahead of the stream; when its queue is empty before the group's end,
``feed`` stops and says which group needs more lookahead, and picks up where it stopped. Memory
is the buffer, the queues and the packs not yet drained (``drain``), never the whole stream.

The deferral buffer keeps its items in bins by token count, each bin a list in stream order, and a
bitmap of the non-empty bins in three levels of 64-bit words: "the largest buffered item that fits in
``room`` tokens" (earliest arrival among equal counts) is the head of the highest non-empty bin at or
below ``room``, found with a few word operations; inserting and removing an item are O(1). (Budgets
over ``MAX_BINS`` tokens share a bin among 2^shift counts, and that bin's list is scanned.) Buffered
items of each mandatory group, and all buffered items, are also chained in stream order, so the
group's earliest one and the window's earliest one are at hand.

The tight policy's cost cap (optional) works in exact integers: a sample of n tokens costs
``cost_linear·n + cost_attention·n²`` (``mmidx.index.cost.LLMGeometry.cost_weights``, the cost model in
small integers), and a pack may cost at most ``(1 + cost_slack / 10,000)`` times a full pack of the stream's
recent average sample: ``cost_linear·max + cost_attention·max·Σn²/Σn``, the sums leaky over the items that
entered the window (each step keeps all but 1/4096 of them), so the cap is carried in the ``Packer`` like
everything else and the packs stay the same at any chunk size.
"""

from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.math cimport sqrt
from libc.stdlib cimport calloc, free, malloc, realloc
from libc.string cimport memmove

import numpy as np


cdef struct Queue:
    int64_t* count
    int64_t* key
    int64_t* rank  # the item's rank among its group's items in the stream
    int64_t head
    int64_t tail
    int64_t capacity


cdef enum:
    LEVELS = 3  # bins of a count's bitmap: 64^3 at most, so MAX_BINS fits
    MAX_BINS = 1 << 16  # larger budgets share a bin among 2^shift counts


cdef struct Buffer:
    int64_t* count
    int64_t* position
    int64_t* key
    int64_t* deferred_at  # packs emitted when the item entered the buffer
    int64_t* prev  # within the item's bin, in stream order; unused nodes chain through ``next``
    int64_t* next
    int64_t* slot  # mandatory slot of the item's group, or -1
    int64_t* before  # chain of a mandatory group's buffered items, in stream order
    int64_t* after
    int64_t* earlier  # chain of all buffered items, in stream order (the tight policy's seeds)
    int64_t* later
    int64_t first  # the earliest buffered item, or -1
    int64_t last
    int64_t* bin_head  # per bin of counts: its earliest item, or -1
    int64_t* bin_tail
    uint64_t* bits[LEVELS]  # bits[0]: which bins hold items; bits[l + 1]: which words of bits[l] are non-zero
    int64_t num_levels
    int64_t shift  # an item of count c sits in bin c >> shift
    int64_t max_count  # the largest count an item can have (max_num_tokens_per_sample)
    int64_t free_list
    int64_t size


cdef extern from *:
    """
    static inline int mmidx_msb64(unsigned long long x) { return 63 - __builtin_clzll(x); }
    """
    int _msb "mmidx_msb64"(uint64_t x) noexcept nogil


cdef int64_t _highest_at_most(Buffer* b, int64_t level, int64_t i) noexcept nogil:
    """The highest set bit of ``bits[level]`` at index <= i, or -1 (one word per level, climbing
    only past empty words)."""
    cdef int64_t word
    cdef uint64_t bits
    if i < 0:
        return -1
    word = i >> 6
    bits = b.bits[level][word] & (0xFFFFFFFFFFFFFFFFULL >> (63 - (i & 63)))
    if bits:
        return (word << 6) | _msb(bits)
    if level + 1 == b.num_levels:  # the top level is one word
        return -1
    word = _highest_at_most(b, level + 1, word - 1)
    if word < 0:
        return -1
    return (word << 6) | _msb(b.bits[level][word])


cdef void _mark(Buffer* b, int64_t i, bint full) noexcept nogil:
    """Set (``full``) or clear bin i's bit, and the bits above it that change with it."""
    cdef int64_t level
    cdef uint64_t was
    for level in range(b.num_levels):
        was = b.bits[level][i >> 6]
        if full:
            b.bits[level][i >> 6] = was | (1ULL << (i & 63))
            if was:
                return
        else:
            b.bits[level][i >> 6] = was & ~(1ULL << (i & 63))
            if b.bits[level][i >> 6]:
                return
        i >>= 6


cdef int64_t _largest_fitting(Buffer* b, int64_t room) noexcept nogil:
    """The node of the largest count <= room (earliest arrival among equals), or -1: the highest
    non-empty bin at or below room's, scanned for its largest fitting count (a bin holds one count
    unless ``shift`` > 0, so the scan stops at its first item)."""
    cdef int64_t i, node, best
    if room < 0 or b.size == 0:
        return -1
    i = _highest_at_most(b, 0, min(room, b.max_count) >> b.shift)
    while i >= 0:
        best = -1
        node = b.bin_head[i]
        if b.shift == 0:
            return node
        while node >= 0:
            if b.count[node] <= room and (best < 0 or b.count[node] > b.count[best]):
                best = node
            node = b.next[node]
        if best >= 0:
            return best
        i = _highest_at_most(b, 0, i - 1)  # only room's own bin can hold nothing that fits
    return -1


cdef int64_t* _grow(int64_t* array, int64_t capacity) except NULL:
    cdef int64_t* grown = <int64_t*> realloc(array, max(capacity, 1) * sizeof(int64_t))
    if grown == NULL:
        raise MemoryError()
    return grown


cdef class Packer:
    """The packing rules of ``mmidx.index.pack_samples``, over a stream fed in chunks.

    Items carry an int64 ``key`` (whatever the caller needs to name them; packs and exclusions
    come back as keys); ``stream_length`` bounds the stream's length (it sizes the buffer). Call
    ``lookahead`` with every mandatory group's items before ``feed`` reaches them, ``end_lookahead``
    once a group has no more, ``drain`` for the finished packs, and ``finish`` at the end.
    """

    cdef int64_t max_num_tokens, expected_num_tokens, max_num_tokens_per_sample
    cdef int64_t prefer_buffer_before, max_buffer_size, capacity
    cdef int64_t num_groups, num_mandatory
    cdef int64_t* slot  # group -> mandatory slot or -1
    cdef Queue* queues
    cdef int64_t* head  # per slot: earliest buffered item (node) or -1
    cdef int64_t* tail
    cdef int64_t* seen  # per slot: items of the group the stream has reached
    cdef int64_t* fed  # per slot: items of the group given to lookahead
    cdef int64_t* popped  # per slot: rank after the last queued item a pack took
    cdef uint8_t* ended  # per slot: lookahead has every item of the group
    cdef Buffer buffer
    cdef int64_t* items  # keys of the drained-not-yet packs, then of the open pack
    cdef int64_t num_buffered_items, items_capacity
    cdef int64_t* pack_ends
    cdef int64_t* pack_tokens
    cdef int64_t num_buffered_packs, packs_capacity
    cdef int64_t* excluded
    cdef int64_t num_buffered_excluded, excluded_capacity
    cdef int64_t open_start, pack_sum, mandatory_next, window, seed_below
    cdef bint opening
    cdef int64_t cost_linear, cost_attention, cost_slack, pack_cost, cost_cap
    cdef int64_t stream_tokens, stream_square_tokens  # leaky sums of n and n² over items entering the window
    cdef readonly bint tight, cost_aware
    cdef readonly int64_t num_packs, num_items, num_excluded, deferred, max_deferral, solo_packs, cost_capped_packs
    cdef readonly int64_t tokens, last_pack_tokens

    def __cinit__(self, const uint8_t[::1] mandatory, int64_t max_num_tokens, int64_t expected_num_tokens,
                  int64_t max_num_tokens_per_sample, int64_t prefer_buffer_before, int64_t max_buffer_size,
                  int64_t stream_length, bint tight=False, int64_t window=0, int64_t cost_linear=0,
                  int64_t cost_attention=0, int64_t cost_slack=-1):
        cdef int64_t g, m, node, bins, words
        cdef Buffer* b = &self.buffer
        # the tight policy's cost cap: on with a slack >= 0 (basis points) and positive integer weights
        self.cost_aware = tight and cost_slack >= 0
        if self.cost_aware and (cost_linear < 0 or cost_attention < 1):
            raise ValueError("the cost cap needs cost weights linear >= 0 and attention >= 1")
        self.cost_linear = cost_linear if self.cost_aware else 0
        self.cost_attention = cost_attention if self.cost_aware else 0
        self.cost_slack = cost_slack
        self.max_num_tokens = max_num_tokens
        self.expected_num_tokens = expected_num_tokens
        self.max_num_tokens_per_sample = max_num_tokens_per_sample
        self.prefer_buffer_before = prefer_buffer_before
        self.max_buffer_size = max_buffer_size
        self.tight = tight
        self.window = max(window, 1)
        self.seed_below = max_num_tokens // 2
        if tight:  # the window never holds more than ``window`` items
            self.capacity = min(self.window + 2, stream_length + 1)
        else:  # the buffer never holds more
            self.capacity = min(max_buffer_size + 2, stream_length + 1)
        self.num_groups = mandatory.shape[0]
        self.slot = _grow(NULL, self.num_groups)
        self.num_mandatory = 0
        for g in range(self.num_groups):
            self.slot[g] = self.num_mandatory if mandatory[g] else -1
            self.num_mandatory += mandatory[g] != 0
        m = max(self.num_mandatory, 1)
        self.queues = <Queue*> malloc(m * sizeof(Queue))
        if self.queues == NULL:
            raise MemoryError()
        for g in range(self.num_mandatory):
            self.queues[g].count = NULL
            self.queues[g].key = NULL
            self.queues[g].rank = NULL
            self.queues[g].head = self.queues[g].tail = self.queues[g].capacity = 0
        self.head = _grow(NULL, m)
        self.tail = _grow(NULL, m)
        self.seen = _grow(NULL, m)
        self.fed = _grow(NULL, m)
        self.popped = _grow(NULL, m)
        self.ended = <uint8_t*> malloc(m)
        if self.ended == NULL:
            raise MemoryError()
        for g in range(self.num_mandatory):
            self.head[g] = self.tail[g] = -1
            self.seen[g] = self.fed[g] = self.popped[g] = 0
            self.ended[g] = 0
        b.count = _grow(NULL, self.capacity)
        b.position = _grow(NULL, self.capacity)
        b.key = _grow(NULL, self.capacity)
        b.deferred_at = _grow(NULL, self.capacity)
        b.prev = _grow(NULL, self.capacity)
        b.next = _grow(NULL, self.capacity)
        b.slot = _grow(NULL, self.capacity)
        b.before = _grow(NULL, self.capacity)
        b.after = _grow(NULL, self.capacity)
        b.earlier = _grow(NULL, self.capacity)
        b.later = _grow(NULL, self.capacity)
        b.first = b.last = -1
        for node in range(self.capacity):
            b.next[node] = node + 1 if node + 1 < self.capacity else -1
        b.free_list = 0
        b.size = 0
        b.max_count = max(max_num_tokens_per_sample, 0)  # larger items are excluded, never buffered
        b.shift = 0
        while (b.max_count >> b.shift) >= MAX_BINS:
            b.shift += 1
        bins = (b.max_count >> b.shift) + 1
        b.bin_head = _grow(NULL, bins)
        b.bin_tail = _grow(NULL, bins)
        for node in range(bins):
            b.bin_head[node] = b.bin_tail[node] = -1
        b.num_levels = 0
        while True:
            words = (bins + 63) // 64
            b.bits[b.num_levels] = <uint64_t*> calloc(words, sizeof(uint64_t))
            if b.bits[b.num_levels] == NULL:
                raise MemoryError()
            b.num_levels += 1
            if words == 1:
                break
            bins = words
        self.items = _grow(NULL, 1)
        self.pack_ends = _grow(NULL, 1)
        self.pack_tokens = _grow(NULL, 1)
        self.excluded = _grow(NULL, 1)
        self.items_capacity = self.packs_capacity = self.excluded_capacity = 1
        self.opening = not tight  # bagel: the first pack opens before the first item

    def __dealloc__(self):
        cdef int64_t m
        if self.queues != NULL:
            for m in range(self.num_mandatory):
                free(self.queues[m].count)
                free(self.queues[m].key)
                free(self.queues[m].rank)
        free(self.queues)
        free(self.slot)
        free(self.head)
        free(self.tail)
        free(self.seen)
        free(self.fed)
        free(self.popped)
        free(self.ended)
        free(self.buffer.count)
        free(self.buffer.position)
        free(self.buffer.key)
        free(self.buffer.deferred_at)
        free(self.buffer.prev)
        free(self.buffer.next)
        free(self.buffer.bin_head)
        free(self.buffer.bin_tail)
        for m in range(LEVELS):
            free(self.buffer.bits[m])
        free(self.buffer.slot)
        free(self.buffer.before)
        free(self.buffer.after)
        free(self.buffer.earlier)
        free(self.buffer.later)
        free(self.items)
        free(self.pack_ends)
        free(self.pack_tokens)
        free(self.excluded)

    # ----------------------------------------------------------------------------------------------
    # The rules, one step each (no allocation: ``_reserve`` made room beforehand)

    cdef void _place(self, int64_t count, int64_t key) noexcept nogil:
        self.items[self.num_buffered_items] = key
        self.num_buffered_items += 1
        self.num_items += 1
        self.pack_sum += count
        self.pack_cost += self._cost(count)  # 0 without the cost cap

    cdef inline int64_t _cost(self, int64_t count) noexcept nogil:
        """A sample's modelled cost in the cost weights' integer units."""
        return self.cost_linear * count + self.cost_attention * count * count

    cdef int64_t _tokens_within(self, int64_t budget) noexcept nogil:
        """The largest count (at most ``max_num_tokens``) whose cost fits ``budget``, or -1. The square
        root only guesses; the integer steps after it make the answer exact."""
        cdef double linear = self.cost_linear, attention = self.cost_attention
        cdef int64_t n
        if budget < 0:
            return -1
        n = <int64_t> min(<double> self.max_num_tokens,
                          (sqrt(linear * linear + 4.0 * attention * budget) - linear) / (2.0 * attention))
        n = max(n, 0)
        while n > 0 and self._cost(n) > budget:
            n -= 1
        while n < self.max_num_tokens and self._cost(n + 1) <= budget:
            n += 1
        return n

    cdef void _set_cost_cap(self) noexcept nogil:
        """The open pack's cost cap: (1 + slack) × the cost of ``max_num_tokens`` tokens of samples whose
        Σn²/Σn is the stream's recent one (no cap before any item, or with only empty ones)."""
        cdef int64_t full
        if self.stream_tokens <= 0:
            self.cost_cap = -1
            return
        # one rounding (a product of a quotient, nothing to fuse), then integers: the same on every machine
        full = self.cost_linear * self.max_num_tokens + <int64_t> (
            <double> (self.cost_attention * self.max_num_tokens)
            * (<double> self.stream_square_tokens / <double> self.stream_tokens))
        self.cost_cap = full + full // 10000 * self.cost_slack + full % 10000 * self.cost_slack // 10000

    cdef bint _over_cost_cap(self, int64_t count) noexcept nogil:
        return self.cost_aware and self.cost_cap >= 0 and self.pack_cost + self._cost(count) > self.cost_cap

    cdef void _fill_under_cost_cap(self) noexcept nogil:
        """Best fit under both budgets: the largest window item that fits the room left in tokens and in
        cost, again and again; counts the pack in ``cost_capped_packs`` if tokens alone would take more.
        (The square root is only taken when the cost, not the tokens, limits the room.)"""
        cdef int64_t node, room
        cdef bint by_cost
        while self.pack_sum < self.max_num_tokens and self.buffer.size > 0:
            room = self.max_num_tokens - self.pack_sum
            by_cost = self.cost_cap >= 0 and self.pack_cost + self._cost(room) > self.cost_cap
            if by_cost:
                room = self._tokens_within(self.cost_cap - self.pack_cost)
            node = _largest_fitting(&self.buffer, room)
            if node < 0:
                if by_cost and _largest_fitting(&self.buffer, self.max_num_tokens - self.pack_sum) >= 0:
                    self.cost_capped_packs += 1
                return
            self._take_from_buffer(node)

    cdef void _buffer_insert(self, int64_t count, int64_t position, int64_t key, int64_t m) noexcept nogil:
        cdef Buffer* b = &self.buffer
        cdef int64_t node = b.free_list, i = count >> b.shift
        b.free_list = b.next[node]
        b.count[node] = count
        b.position[node] = position
        b.key[node] = key
        b.deferred_at[node] = self.num_packs
        b.slot[node] = m
        b.prev[node] = b.bin_tail[i]  # items enter the buffer in stream order: append to the bin
        b.next[node] = -1
        if b.bin_tail[i] >= 0:
            b.next[b.bin_tail[i]] = node
        else:
            b.bin_head[i] = node
            _mark(b, i, True)
        b.bin_tail[i] = node
        b.size += 1
        b.earlier[node] = b.last
        b.later[node] = -1
        if b.last >= 0:
            b.later[b.last] = node
        else:
            b.first = node
        b.last = node
        if m >= 0:  # items enter the buffer in stream order: append to the group's chain
            b.before[node] = self.tail[m]
            b.after[node] = -1
            if self.tail[m] >= 0:
                b.after[self.tail[m]] = node
            else:
                self.head[m] = node
            self.tail[m] = node

    cdef void _take_from_buffer(self, int64_t node) noexcept nogil:
        """Place a buffered item into the open pack and drop it from the buffer."""
        cdef Buffer* b = &self.buffer
        cdef int64_t m = b.slot[node], i = b.count[node] >> b.shift
        self.max_deferral = max(self.max_deferral, self.num_packs - b.deferred_at[node])
        if m >= 0:
            if b.before[node] >= 0:
                b.after[b.before[node]] = b.after[node]
            else:
                self.head[m] = b.after[node]
            if b.after[node] >= 0:
                b.before[b.after[node]] = b.before[node]
            else:
                self.tail[m] = b.before[node]
        if b.earlier[node] >= 0:
            b.later[b.earlier[node]] = b.later[node]
        else:
            b.first = b.later[node]
        if b.later[node] >= 0:
            b.earlier[b.later[node]] = b.earlier[node]
        else:
            b.last = b.earlier[node]
        if b.prev[node] >= 0:
            b.next[b.prev[node]] = b.next[node]
        else:
            b.bin_head[i] = b.next[node]
        if b.next[node] >= 0:
            b.prev[b.next[node]] = b.prev[node]
        else:
            b.bin_tail[i] = b.prev[node]
        if b.bin_head[i] < 0:
            _mark(b, i, False)
        b.next[node] = b.free_list
        b.free_list = node
        b.size -= 1
        self._place(b.count[node], b.key[node])

    cdef void _close(self) noexcept nogil:
        """Emit the open pack, if it holds anything."""
        if self.num_buffered_items > self.open_start:
            self.pack_ends[self.num_buffered_packs] = self.num_buffered_items
            self.pack_tokens[self.num_buffered_packs] = self.pack_sum
            self.num_buffered_packs += 1
            self.num_packs += 1
            self.tokens += self.pack_sum
            self.last_pack_tokens = self.pack_sum
            self.open_start = self.num_buffered_items
            self.pack_sum = 0
            self.pack_cost = 0

    cdef int64_t _place_mandatory(self) noexcept nogil:
        """One item of each mandatory group, in group order: the group's earliest unplaced one (a
        buffered one, else the front of its queue). Returns -1, or the slot whose queue ran dry
        before the group's end (``mandatory_next`` keeps the place to resume from)."""
        cdef int64_t m, node
        cdef Queue* q
        for m in range(self.mandatory_next, self.num_mandatory):
            self.mandatory_next = m
            node = self.head[m]
            if node >= 0:
                if self.pack_sum + self.buffer.count[node] <= self.max_num_tokens:
                    self._take_from_buffer(node)
                continue  # one that does not fit stays first in line for the next pack
            q = &self.queues[m]
            if q.head < q.tail:
                if self.pack_sum + q.count[q.head] <= self.max_num_tokens:
                    self._place(q.count[q.head], q.key[q.head])
                    self.popped[m] = q.rank[q.head] + 1
                    q.head += 1
                continue
            if not self.ended[m]:
                return m
        self.mandatory_next = self.num_mandatory
        return -1

    cdef void _fill_from_buffer(self, int64_t below) noexcept nogil:
        """Add the largest buffered item that fits, again and again, while the pack holds fewer
        than ``below`` tokens."""
        cdef int64_t node
        while self.pack_sum < below and self.buffer.size > 0:
            node = _largest_fitting(&self.buffer, self.max_num_tokens - self.pack_sum)
            if node < 0:
                return
            self._take_from_buffer(node)

    cdef void _emit_solo(self) noexcept nogil:
        """Emit the largest buffered item as a pack of its own, ahead of the open pack (which so
        far holds only mandatory items, so shifting them by one slot is cheap)."""
        cdef int64_t start = self.open_start
        cdef int64_t already = self.num_buffered_items - start
        cdef int64_t held = self.pack_sum
        cdef int64_t node = _largest_fitting(&self.buffer, self.max_num_tokens)
        memmove(&self.items[start + 1], &self.items[start], already * sizeof(int64_t))
        self.num_buffered_items = start
        self.num_items -= already
        self.pack_sum = 0
        self._take_from_buffer(node)
        self._close()
        self.num_buffered_items = start + 1 + already
        self.num_items += already
        self.pack_sum = held
        self.solo_packs += 1

    cdef int64_t _open(self) noexcept nogil:
        """Start a pack: mandatory items, then the buffer (up to ``prefer_buffer_before`` tokens);
        keep the buffer bounded with a solo pack; close at once if that already reached expected.
        Returns -1, or the slot that needs lookahead (then ``opening`` stays set to resume)."""
        cdef int64_t needed
        self.opening = True
        while True:
            needed = self._place_mandatory()
            if needed >= 0:
                return needed
            self.mandatory_next = 0
            self._fill_from_buffer(self.prefer_buffer_before)
            if self.buffer.size > self.max_buffer_size:
                self._emit_solo()
            if self.pack_sum < self.expected_num_tokens:
                self.opening = False
                return -1
            self._close()

    cdef int64_t _tight_pack(self) noexcept nogil:
        """The tight policy's pack: mandatory items, then the window's earliest items in stream order
        while the pack holds under half of ``max_num_tokens`` (the blend's order), then best fit: the
        largest window item that fits the room left, again and again, until none fits. With the cost
        cap, an item fits only if the pack's cost stays under the cap too (except the first seed: the
        window's earliest item always goes in, which bounds how far an item moves). Returns -1, or the
        slot that needs lookahead (then ``opening`` stays set to resume: the cap is the same then, as no
        item entered the window since)."""
        cdef int64_t needed, node
        cdef bint seeded = False
        cdef Buffer* b = &self.buffer
        self.opening = True
        if self.cost_aware:
            self._set_cost_cap()
        needed = self._place_mandatory()
        if needed >= 0:
            return needed
        self.mandatory_next = 0
        while b.first >= 0 and self.pack_sum < self.seed_below:
            node = b.first
            if self.pack_sum + b.count[node] > self.max_num_tokens or (seeded and self._over_cost_cap(b.count[node])):
                break
            self._take_from_buffer(node)
            seeded = True
        if self.cost_aware:
            self._fill_under_cost_cap()
        else:
            self._fill_from_buffer(self.max_num_tokens)
        self._close()
        self.opening = False
        return -1

    cdef int64_t _tight_packs(self) noexcept nogil:
        """Close tight packs while the window is full. Returns -1, or the slot that needs lookahead."""
        cdef int64_t needed
        while self.buffer.size >= self.window:
            needed = self._tight_pack()
            if needed >= 0:
                return needed
        return -1

    # ----------------------------------------------------------------------------------------------
    # The interface

    def _reserve(self, int64_t items, int64_t excluded):
        """Room for ``items`` more placed items (and as many packs) and ``excluded`` exclusions."""
        cdef int64_t m, queued = 0
        for m in range(self.num_mandatory):
            queued += self.queues[m].tail - self.queues[m].head
        items += self.buffer.size + queued + 1
        if self.num_buffered_items + items > self.items_capacity:
            self.items_capacity = max(2 * self.items_capacity, self.num_buffered_items + items)
            self.items = _grow(self.items, self.items_capacity)
        if self.num_buffered_packs + items > self.packs_capacity:
            self.packs_capacity = max(2 * self.packs_capacity, self.num_buffered_packs + items)
            self.pack_ends = _grow(self.pack_ends, self.packs_capacity)
            self.pack_tokens = _grow(self.pack_tokens, self.packs_capacity)
        if self.num_buffered_excluded + excluded > self.excluded_capacity:
            self.excluded_capacity = max(2 * self.excluded_capacity, self.num_buffered_excluded + excluded)
            self.excluded = _grow(self.excluded, self.excluded_capacity)

    def lookahead(self, const int64_t[::1] counts, const int32_t[::1] groups, const int64_t[::1] keys,
                  const uint8_t[::1] take):
        """Queue the items of the groups with ``take[g]`` set (mandatory groups, in stream order,
        continuing what was queued for them before). Returns -1, or the first bad position."""
        cdef int64_t n = counts.shape[0], i, g, m, needed, length, bad = -1
        cdef Queue* q
        if groups.shape[0] != n or keys.shape[0] != n or take.shape[0] != self.num_groups:
            raise ValueError("lookahead needs counts, groups and keys of one length and a flag per group")
        for g in range(self.num_groups):
            if take[g] and self.slot[g] < 0:
                raise ValueError(f"group {g} is not mandatory: only mandatory groups have lookahead")
        for m in range(self.num_mandatory):  # compact, then grow, each queue to room for n more
            q = &self.queues[m]
            length = q.tail - q.head
            if q.head > 0 and length > 0:
                memmove(q.count, &q.count[q.head], length * sizeof(int64_t))
                memmove(q.key, &q.key[q.head], length * sizeof(int64_t))
                memmove(q.rank, &q.rank[q.head], length * sizeof(int64_t))
            q.head, q.tail = 0, length
            needed = length + n
            if needed > q.capacity:
                q.capacity = max(2 * q.capacity, needed)
                q.count = _grow(q.count, q.capacity)
                q.key = _grow(q.key, q.capacity)
                q.rank = _grow(q.rank, q.capacity)
        with nogil:
            for i in range(n):
                g = groups[i]
                if g < 0 or g >= self.num_groups or counts[i] < 0:
                    bad = i
                    break
                if not take[g]:
                    continue
                m = self.slot[g]
                q = &self.queues[m]
                if counts[i] <= self.max_num_tokens_per_sample:  # excluded items never join a pack
                    q.count[q.tail] = counts[i]
                    q.key[q.tail] = keys[i]
                    q.rank[q.tail] = self.fed[m]
                    q.tail += 1
                self.fed[m] += 1
        return bad

    def restart_lookahead(self, int64_t group):
        """Forget what group ``group``'s lookahead holds beyond the items the stream has reached and the
        packs have taken (a schedule's new phase decides anew which of the group's items the stream
        holds): returns the rank of the first item neither reached nor taken, from which ``lookahead``
        continues (the same however far lookahead had read); the group is no longer ended."""
        if not 0 <= group < self.num_groups or self.slot[group] < 0:
            raise ValueError(f"group {group} is not a mandatory group")
        cdef int64_t m = self.slot[group]
        self.queues[m].head = self.queues[m].tail = 0
        self.fed[m] = max(self.seen[m], self.popped[m])
        self.ended[m] = 0
        return self.fed[m]

    def end_lookahead(self, int64_t group):
        """Group ``group`` (mandatory) has no items beyond those given to ``lookahead``."""
        if not 0 <= group < self.num_groups or self.slot[group] < 0:
            raise ValueError(f"group {group} is not a mandatory group")
        self.ended[self.slot[group]] = 1

    def feed(self, const int64_t[::1] counts, const int32_t[::1] groups, const int64_t[::1] keys,
             int64_t start, int64_t begin, int64_t stop_packs=-1, int64_t stop_tokens=-1):
        """Pack items ``begin:`` of a chunk whose item 0 is stream position ``start``.

        Returns (next, needed): ``next`` is where to resume in the chunk (its length when done);
        ``needed`` is -1, or the mandatory group whose lookahead ran out (give it more, then call
        again from ``next``), or -2 - position for an item whose group or count is invalid.
        ``stop_packs`` / ``stop_tokens`` (-1: none) stop the feed before the first item that comes
        after the packing (a resumed pack start included) that closed that many packs or packed that
        many tokens (a schedule's phase ends there): ``next`` is that item.
        """
        cdef int64_t n = counts.shape[0], i, g, m, count, rank = 0, needed = -1, stop = n, bad = -1
        cdef Queue* q
        if groups.shape[0] != n or keys.shape[0] != n or not 0 <= begin <= n:
            raise ValueError("feed needs counts, groups and keys of one length and 0 <= begin <= length")
        self._reserve(n - begin, n - begin)
        with nogil:
            if self.tight:
                if self.opening:
                    needed = self._tight_pack()
                if needed < 0:
                    needed = self._tight_packs()
                if needed >= 0:
                    stop = begin
            elif self.opening:
                needed = self._open()
                if needed >= 0:
                    stop = begin
            if needed < 0:
                for i in range(begin, n):
                    if ((stop_packs >= 0 and self.num_packs >= stop_packs)
                            or (stop_tokens >= 0 and self.tokens >= stop_tokens)):
                        stop = i
                        break
                    g = groups[i]
                    count = counts[i]
                    if g < 0 or g >= self.num_groups or count < 0:
                        bad = start + i
                        stop = i
                        break
                    m = self.slot[g]
                    if m >= 0:
                        rank = self.seen[m]
                        self.seen[m] += 1
                    if count > self.max_num_tokens_per_sample:
                        self.excluded[self.num_buffered_excluded] = keys[i]
                        self.num_buffered_excluded += 1
                        self.num_excluded += 1
                        continue
                    if m >= 0:
                        q = &self.queues[m]
                        if q.head < q.tail and q.rank[q.head] == rank:
                            q.head += 1  # the stream reaches it first
                        else:
                            continue  # an earlier pack took it as its mandatory item
                    if self.tight:  # every item enters the window; packs close while it is full
                        if self.cost_aware:  # leaky sums: each item keeps all but 1/4096 of them
                            self.stream_tokens += count - (self.stream_tokens >> 12)
                            self.stream_square_tokens += count * count - (self.stream_square_tokens >> 12)
                        self._buffer_insert(count, start + i, keys[i], m)
                        needed = self._tight_packs()
                        if needed >= 0:
                            stop = i + 1
                            break
                        continue
                    if self.pack_sum + count <= self.max_num_tokens:
                        self._place(count, keys[i])
                    else:
                        self._buffer_insert(count, start + i, keys[i], m)
                        self.deferred += 1
                    if self.pack_sum >= self.expected_num_tokens or self.buffer.size > self.max_buffer_size:
                        self._close()
                        needed = self._open()
                        if needed >= 0:
                            stop = i + 1
                            break
        if bad >= 0:
            return stop, -2 - bad
        return stop, (self._group_of(needed) if needed >= 0 else -1)

    cdef int64_t _group_of(self, int64_t m) noexcept nogil:
        cdef int64_t g
        for g in range(self.num_groups):
            if self.slot[g] == m:
                return g
        return -1

    def finish(self):
        """The stream is spent: drain the buffer, each pack filled up to expected."""
        cdef int64_t m
        for m in range(self.num_mandatory):
            if self.queues[m].head < self.queues[m].tail:
                raise ValueError("finish before the stream reached every item given to lookahead")
            self.ended[m] = 1
        self._reserve(0, 0)
        with nogil:
            if self.tight:
                if self.opening:
                    self._tight_pack()
                while self.buffer.size > 0:
                    self._tight_pack()
            else:
                if self.opening:
                    self._open()
                self._fill_from_buffer(self.expected_num_tokens)
                self._close()
                while self.buffer.size > 0:
                    self.mandatory_next = 0
                    self._place_mandatory()
                    self._fill_from_buffer(self.expected_num_tokens)
                    self._close()

    def drain(self):
        """(keys of the items of the packs closed since the last drain, in pack order; each pack's
        end in that array; each pack's tokens; keys of the items excluded since), as new arrays."""
        cdef int64_t done = self.open_start, rest = self.num_buffered_items - self.open_start
        items = np.array(<int64_t[:max(done, 1)]> self.items)[:done]
        ends = np.array(<int64_t[:max(self.num_buffered_packs, 1)]> self.pack_ends)[:self.num_buffered_packs]
        tokens = np.array(<int64_t[:max(self.num_buffered_packs, 1)]> self.pack_tokens)[:self.num_buffered_packs]
        excluded = np.array(<int64_t[:max(self.num_buffered_excluded, 1)]> self.excluded)[
            :self.num_buffered_excluded]
        memmove(self.items, &self.items[done], rest * sizeof(int64_t))
        self.num_buffered_items = rest
        self.open_start = 0
        self.num_buffered_packs = 0
        self.num_buffered_excluded = 0
        return items, ends, tokens, excluded


cdef inline uint64_t _read(const uint8_t* data, int width, int64_t i) noexcept nogil:
    """Element i of a little-endian unsigned array of ``width``-byte elements."""
    cdef uint64_t value = 0
    cdef int b
    for b in range(width):
        value |= (<uint64_t> data[i * width + b]) << (8 * b)
    return value


cdef class PackReader:
    """The items of any pack, read from the raw bytes of a pack index's unsigned arrays
    (``view_width`` 0: every view is 0). Holds the arrays' views, so a call costs no argument
    conversion; pickles as its arguments."""

    cdef const uint8_t[::1] offsets, samples, views
    cdef int offset_width, sample_width, view_width
    cdef const int64_t[::1] dataset_starts, dataset_group, dataset_number
    cdef object item_type, arguments

    def __init__(self, offsets, int offset_width, samples, int sample_width, views, int view_width,
                 dataset_starts, dataset_group, dataset_number, item_type):
        self.arguments = (offsets, offset_width, samples, sample_width, views, view_width, dataset_starts,
                          dataset_group, dataset_number, item_type)
        self.offsets, self.samples, self.views = offsets, samples, views
        self.offset_width, self.sample_width, self.view_width = offset_width, sample_width, view_width
        self.dataset_starts, self.dataset_group, self.dataset_number = dataset_starts, dataset_group, dataset_number
        self.item_type = item_type

    def __reduce__(self):
        return PackReader, self.arguments

    def items(self, int64_t pack):
        """Pack ``pack``'s items, each an ``item_type`` (a tuple subclass) of (group, dataset, sample,
        view); an error text instead when the arrays name items or samples they do not hold."""
        cdef int64_t num_items = self.samples.shape[0] // max(self.sample_width, 1)
        cdef int64_t num_datasets = self.dataset_starts.shape[0] - 1
        cdef uint64_t first = _read(&self.offsets[0], self.offset_width, pack)
        cdef uint64_t last = _read(&self.offsets[0], self.offset_width, pack + 1)
        cdef uint64_t i, number
        cdef int64_t low, high, middle
        if first > last or last > <uint64_t> num_items:
            return f"pack {pack} spans items [{first}, {last}) of {num_items}"
        items = []
        for i in range(first, last):
            number = _read(&self.samples[0], self.sample_width, i)
            if number >= <uint64_t> self.dataset_starts[num_datasets]:
                return f"pack {pack} names sample {number}, beyond the datasets' {self.dataset_starts[num_datasets]}"
            low, high = 0, num_datasets - 1  # the last dataset starting at or before the sample
            while low < high:
                middle = (low + high + 1) // 2
                if <uint64_t> self.dataset_starts[middle] <= number:
                    low = middle
                else:
                    high = middle - 1
            # tuple.__new__ fills the named tuple without a Python-level constructor call per item
            items.append(tuple.__new__(self.item_type, (
                self.dataset_group[low], self.dataset_number[low], number - <uint64_t> self.dataset_starts[low],
                _read(&self.views[0], self.view_width, i) if self.view_width else 0)))
        return items
