"""The data cache of remote files (mmidx.io.block_cache, mmidx.io.cache_folder): reads equal the file's bytes
through any limit; entries are checked and a bad one is fetched again; the folder stays within its limit when
several processes share it; kill -9 at any moment leaves a cache the next process repairs; eviction keeps what
is read soonest (Belady), and a replay of the same trace hits at least as often as LRU."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmidx.io import block_cache
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.block_store import HEADROOM, NEVER, keep_nearest
from mmidx.io.cache_accounting import repair
from mmidx.io.cache_admin import cache_info, clear_cache
from mmidx.io.cache_folder import (
    CacheError,
    CacheSettings,
    cache_settings,
    checked,
    create,
    folder_bytes,
    parse_size,
    read_state,
    smallest_limit,
)
from mmidx.read.next_use import STEP, NextUse, next_reads, simulate

BLOCK = 4096
SHA = "ab" * 32


def blob_of(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class Source:
    """A remote file stood in for by bytes: ``fetch(a, b)`` as RemoteFile's ranged request, counted."""

    def __init__(self, data):
        self.data, self.calls = data, []

    def __call__(self, start, stop):
        self.calls.append((start, stop))
        return self.data[start:stop]


def key_of(data, sha=SHA, role="images"):
    return FileKey(sha, role, f"s3://bucket/ds.{role}", "s3://bucket/ds", len(data))


def opened(tmp_path, limit, block=BLOCK):
    return BlockCache(CacheSettings(tmp_path / "cache", limit), block_size=block)


def consistent(cache):
    """The state's count of bytes equals what the folder holds, and it is within the limit."""
    cache.flush()
    state = read_state(cache.data)
    measured = folder_bytes(cache.data)
    return state["bytes"] == measured <= cache.limit and not state["busy"]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 200_000), st.integers(0, 40), st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)),
                                                          min_size=1, max_size=40))
def test_reads_through_the_cache_equal_the_file_for_any_range_and_limit(tmp_path_factory, size, blocks, reads):
    folder = tmp_path_factory.mktemp("c")
    data = blob_of(size)
    source, key = Source(data), key_of(data)
    cache = opened(folder, smallest_limit(BLOCK) + blocks * BLOCK)
    for a, b in reads:
        start, stop = sorted((int(a * size), int(b * size)))
        stop = max(stop, start + 1) if start < size else size
        start = min(start, size - 1)
        assert cache.read(key, start, stop, source) == data[start:stop]
        assert folder_bytes(cache.data) <= cache.limit
    assert consistent(cache)


def test_a_second_read_is_served_from_the_cache_with_no_request(tmp_path):
    data = blob_of(50_000)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 1 << 20)
    assert cache.read(key, 100, 30_000, source) == data[100:30_000]
    assert source.calls == [(0, 32_768)]  # the blocks around the range, in one request
    assert cache.read(key, 5_000, 20_000, source) == data[5_000:20_000]
    assert len(source.calls) == 1
    cache.flush()
    run = read_state(cache.data)["run"]
    assert (run["hits"], run["misses"], run["bytes_fetched"]) == (4, 8, 32_768)


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "another block's entry", "empty"])
def test_a_bad_entry_is_dropped_and_fetched_again_never_served(tmp_path, damage):
    data = blob_of(40_000)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 1 << 20)
    cache.read(key, 0, len(data), source)
    entry = cache.data / SHA / "images" / "3"
    raw = bytearray(entry.read_bytes())
    if damage == "flip a byte":
        raw[-7] ^= 1
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "another block's entry":
        raw = bytearray((cache.data / SHA / "images" / "4").read_bytes())
    else:
        raw = bytearray()
    entry.write_bytes(raw)
    calls = len(source.calls)
    # The process that stored the block serves the bytes it checked, from memory (never the damaged file's):
    assert cache.read(key, 3 * BLOCK + 10, 3 * BLOCK + 2000, source) == data[3 * BLOCK + 10:3 * BLOCK + 2000]
    assert len(source.calls) == calls
    other = opened(tmp_path, 1 << 20)  # another process reads the damaged entry from the folder
    assert other.read(key, 3 * BLOCK + 10, 3 * BLOCK + 2000, source) == data[3 * BLOCK + 10:3 * BLOCK + 2000]
    assert source.calls[calls:] == [(3 * BLOCK, 4 * BLOCK)]  # fetched again
    other.flush()
    assert read_state(cache.data)["run"]["dropped"] == 1
    assert other.read(key, 3 * BLOCK, 4 * BLOCK, source) == data[3 * BLOCK:4 * BLOCK]  # stored again, good
    assert opened(tmp_path, 1 << 20).read(key, 3 * BLOCK, 4 * BLOCK, source) == data[3 * BLOCK:4 * BLOCK]
    assert len(source.calls) == calls + 1 and consistent(other)


def test_a_block_read_again_is_served_from_the_processs_memory_without_opening_its_entry(tmp_path):
    data = blob_of(10 * BLOCK + 123)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 1 << 20)
    assert cache.read(key, 0, len(data), source) == data  # fetched, stored and kept
    assert opened(tmp_path, 1 << 20).read(key, 0, len(data), source) == data  # read back and checked, kept
    entries = cache.data / SHA / "images"
    for entry in entries.iterdir():
        entry.unlink()  # gone by hand: the folder no longer holds these bytes, the cache's arrays still say so
    for start, stop in [(0, 1), (5, 3 * BLOCK + 9), (2 * BLOCK, 3 * BLOCK), (9 * BLOCK + 7, len(data))]:
        assert cache.read(key, start, stop, source) == data[start:stop]
        assert cache.at_hand(key, start, stop) == data[start:stop]
        assert cache.read(key, start, stop, source).readonly  # nobody can change what the process keeps
    assert source.calls == [(0, len(data))]  # no request, no entry opened
    assert opened(tmp_path, 1 << 20).read(key, 0, BLOCK, source) == data[:BLOCK]  # another process fetches
    assert source.calls[1:] == [(0, BLOCK)]


def test_a_kept_block_another_process_evicted_is_a_miss_read_from_the_cache_again(tmp_path):
    data, other = blob_of(8 * BLOCK), blob_of(40 * BLOCK, 1)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 16 * 2 * BLOCK)  # 16 entries of a header and a block (2 pages each), less the arrays
    assert cache.read(key, 0, 4 * BLOCK, source) == data[:4 * BLOCK]
    assert cache.at_hand(key, 0, 4 * BLOCK) == data[:4 * BLOCK]
    neighbour = opened(tmp_path, 16 * 2 * BLOCK)  # another process reads another file: the least recently read go
    for block in range(40):
        neighbour.read(key_of(other, role="bin"), block * BLOCK, (block + 1) * BLOCK, Source(other))
    assert not (cache.data / SHA / "images" / "0").exists()
    assert cache.at_hand(key, 0, BLOCK) is None  # evicted: no longer a hit, though this process kept its bytes
    assert cache.read(key, 0, BLOCK, source) == data[:BLOCK]
    assert source.calls == [(0, 4 * BLOCK), (0, BLOCK)]  # a miss, fetched again
    assert cache.at_hand(key, 0, BLOCK) == data[:BLOCK] and consistent(cache)


def test_a_read_of_kept_blocks_never_waits_for_a_store_under_way(tmp_path):
    data = blob_of(8 * BLOCK)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 1 << 20)
    cache.read(key, 0, len(data), source)
    cache._flushed = 0  # its counters are due to be added to the state
    served = []
    with cache._lock, cache.accounting.hold():  # another thread of the process storing, the folder's lock held
        reader = threading.Thread(target=lambda: served.append(cache.read(key, 5, 3 * BLOCK, source)))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive() and served == [data[5:3 * BLOCK]]
    cache.flush()
    assert read_state(cache.data)["run"]["hits"] == 3 and len(source.calls) == 1


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 6), st.lists(st.tuples(st.integers(0, 20 * BLOCK - 1), st.integers(1, 5 * BLOCK)),
                                   min_size=1, max_size=30))
def test_the_blocks_a_process_keeps_stay_within_its_bound(tmp_path_factory, kept_blocks, reads):
    data = blob_of(20 * BLOCK)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path_factory.mktemp("c"), 1 << 20)
    cache.kept.limit = kept_blocks * BLOCK
    for start, length in reads:
        stop = min(start + length, len(data))
        assert cache.read(key, start, stop, source) == data[start:stop]
        held = cache.kept._blocks.values()
        assert cache.kept.bytes == sum(len(kept.data) for kept in held) <= cache.kept.limit
        assert all(kept.data == data[block * BLOCK:(block + 1) * BLOCK]
                   for (_, _, block), kept in cache.kept._blocks.items())


def test_a_changed_dataset_never_serves_the_old_versions_bytes(tmp_path):
    old, new = blob_of(20_000, 1), blob_of(20_000, 2)
    cache = opened(tmp_path, 1 << 20)
    assert cache.read(key_of(old, "01" * 32), 0, 20_000, Source(old)) == old
    assert cache.read(key_of(new, "02" * 32), 0, 20_000, Source(new)) == new  # same URI, another meta_sha256


def test_a_limit_is_kept_and_the_bytes_read_soonest_stay(tmp_path):
    """With a policy saying block 0 is read next and the others never, block 0 is never evicted."""
    data = blob_of(40 * BLOCK)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 12 * BLOCK + 6 * 4096)

    class Soonest:
        def next_use(self, key, blocks, pack):
            return np.where(np.asarray(blocks) == 0, 1, NEVER)

    cache.policy = Soonest()
    for block in range(40):
        cache.read(key, block * BLOCK, (block + 1) * BLOCK, source)
        assert (cache.data / SHA / "images" / "0").exists()
    assert consistent(cache)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 5), st.integers(1, 4)), min_size=1, max_size=30),
       st.integers(0, 80), st.integers(0, 10))
def test_keep_nearest_keeps_a_prefix_of_the_soonest_read_within_the_room(entries, room, headroom):
    next_use = np.array([e[0] for e in entries], dtype=np.int64)
    touched = np.array([e[1] for e in entries], dtype=np.uint64)
    sizes = np.array([e[2] for e in entries], dtype=np.int64)
    keep = keep_nearest(next_use, touched, sizes, room, headroom)
    if sizes.sum() <= room:
        assert keep.all()
        return
    assert sizes[keep].sum() <= max(room - headroom, 0)
    kept = [(n, -t) for n, t, k in zip(next_use, touched.astype(int), keep, strict=True) if k]
    dropped = [(n, -t) for n, t, k in zip(next_use, touched.astype(int), keep, strict=True) if not k]
    assert not kept or not dropped or max(kept) <= min(dropped)  # nothing read later is kept over one read sooner
    if dropped:  # and as many as fit: the first one dropped did not fit
        first = min(range(len(entries)), key=lambda i: (keep[i], next_use[i], -int(touched[i])))
        assert sizes[keep].sum() + sizes[first] > room - headroom


def lru_reference(trace, capacity):
    """Hits of a textbook LRU cache of ``capacity`` equal blocks, over steps of block sets (a step's blocks used
    in ascending order; the least recently used evicted after each step)."""
    cache, hits = OrderedDict(), 0
    for blocks in trace:
        for block in sorted(set(blocks)):
            if block in cache:
                hits += 1
                cache.move_to_end(block)
            else:
                cache[block] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=6), min_size=1, max_size=40), st.integers(6, 30))
def test_a_replay_by_next_use_hits_at_least_as_often_as_lru_and_lru_replays_as_the_textbook(trace, capacity):
    uses = np.unique(np.array([block * STEP + step for step, blocks in enumerate(trace) for block in blocks]))
    sizes = {("s", "r"): 31 * BLOCK}
    entry = 2 * 4096  # a block of 4096 bytes and its header take two pages
    # the limit whose headroom (limit // 32) still leaves room for `capacity` entries, and no more up to 30: both
    # policies hold the same entries, so a replay by next use is Belady's and can never hit less
    limit = -(-capacity * entry * HEADROOM // (HEADROOM - 1))
    by_use = simulate({("s", "r"): uses}, sizes, BLOCK, limit, "next-use")
    by_lru = simulate({("s", "r"): uses}, sizes, BLOCK, limit, "lru")
    assert by_lru["bytes_hit"] == lru_reference(trace, capacity) * BLOCK
    assert by_use["bytes_hit"] >= by_lru["bytes_hit"]


def test_next_reads_finds_the_first_use_at_or_after_a_step():
    uses = np.array(sorted([3 * STEP + 5, 3 * STEP + 9, 7 * STEP + 2]), dtype=np.int64)
    assert next_reads(uses, np.array([3, 7, 4]), 0).tolist() == [5, 2, NEVER]
    assert next_reads(uses, np.array([3, 7, 4]), 6).tolist() == [9, NEVER, NEVER]
    assert next_reads(uses, np.array([3, 7]), 2).tolist() == [5, 2]


def _reader(folder, limit, seed, rounds, done):
    """A process reading random ranges of the shared file through the shared cache, checking every byte."""
    data = blob_of(300 * BLOCK)
    cache = BlockCache.of(CacheSettings(folder, limit))
    rng = np.random.default_rng(seed)
    for _ in range(rounds):
        start = int(rng.integers(0, len(data) - 1))
        stop = min(len(data), start + int(rng.integers(1, 6 * BLOCK)))
        if cache.read(key_of(data), start, stop, Source(data)) != data[start:stop]:
            done.put("wrong bytes")
            return
    cache.flush()
    done.put("ok")


def test_several_processes_share_one_cache_under_eviction_within_its_limit(tmp_path):
    folder, limit = tmp_path / "cache", 40 * 2 * 4096
    create(folder, BLOCK)
    done = multiprocessing.get_context("fork").Queue()
    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], folder_bytes(folder / "data"))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    workers = [multiprocessing.get_context("fork").Process(target=_reader, args=(folder, limit, seed, 150, done))
               for seed in range(3)]
    for worker in workers:
        worker.start()
    results = [done.get(timeout=240) for _ in workers]
    for worker in workers:
        worker.join()
    stop.set()
    sampler.join()
    assert results == ["ok"] * 3
    assert 0 < peak[0] <= limit
    state = read_state(folder / "data")
    assert state["run"]["evicted"] > 0 and state["run"]["hits"] > 0
    assert state["bytes"] == folder_bytes(folder / "data") and not state["busy"]


WRITER = """
import builtins
import sys
import time
import numpy as np
from mmidx.io import block_store
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.cache_folder import CacheSettings


class Slow:  # entries written 64 KiB at a time, slowly: most kills land in the middle of one
    def __init__(self, stream):
        self.stream = stream

    def write(self, data):
        view = memoryview(data)
        for start in range(0, len(view), 1 << 16):
            self.stream.write(view[start:start + (1 << 16)])
            self.stream.flush()
            time.sleep(0.001)

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stream.close()


block_store.open = lambda path, mode="r", *rest: Slow(builtins.open(path, mode, *rest)) if mode == "wb" else \
    builtins.open(path, mode, *rest)
data = np.random.default_rng(0).integers(0, 256, 64 << 20, dtype=np.uint8).tobytes()
key = FileKey("cd" * 32, "bin", "s3://b/x.bin", "s3://b/x", len(data))
cache = BlockCache.of(CacheSettings(sys.argv[1], int(sys.argv[2])))
rng = np.random.default_rng(int(sys.argv[3]))
print("ready", flush=True)
while True:
    start = int(rng.integers(0, len(data) - 1))
    cache.read(key, start, min(len(data), start + (3 << 20)), lambda a, b: data[a:b])
"""


def test_kill_9_at_any_moment_leaves_a_cache_the_next_process_repairs_and_nothing_read_as_data(tmp_path):
    folder, limit = tmp_path / "cache", 24 << 20
    create(folder, 1 << 20)
    rng = np.random.default_rng(0)
    for attempt in range(8):
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(folder), str(limit), str(attempt)],
                                  stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert writer.stdout.readline().strip() == b"ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        writer.send_signal(signal.SIGKILL)
        writer.wait()
    data = blob_of(64 << 20)
    stored = sorted(int(p.name) for p in (folder / "data" / ("cd" * 32) / "bin").iterdir())
    key = FileKey("cd" * 32, "bin", "s3://b/x.bin", "s3://b/x", len(data))
    cache = BlockCache.of(CacheSettings(folder, limit))  # the next process: repairs if a writer died mid-change
    assert not list((folder / "data" / "tmp").iterdir())  # no temporary left
    source = Source(data)
    for block in stored:  # every entry that survived is whole: written under a temporary name, then renamed
        assert cache.read(key, block << 20, min(len(data), (block + 1) << 20), source) == \
            data[block << 20:(block + 1) << 20]
    assert stored and not source.calls
    cache.flush()
    assert read_state(folder / "data")["run"]["dropped"] == 0 and consistent(cache)


def test_a_state_left_busy_is_repaired_with_its_temporaries_and_half_made_roles(tmp_path):
    data = blob_of(30_000)
    cache = opened(tmp_path, 1 << 20)
    cache.read(key_of(data), 0, len(data), Source(data))
    cache.flush()
    state = read_state(cache.data)
    (cache.data / "state.json").write_text(json.dumps({**state, "busy": 1, "bytes": 1}))
    (cache.data / "tmp" / "123.4").write_bytes(b"x" * 5000)  # a writer killed before its rename
    (cache.data / SHA / "bin").mkdir()  # a role killed before its JSON
    (cache.data / SHA / "bin.present").write_bytes(b"\0" * 8)
    (cache.data / "tmp" / "used").write_bytes(b"")
    os.replace(cache.data / "tmp" / "used", cache.data / SHA / "images.used")  # a hint of the wrong size
    (cache.data / "mine.txt").write_text("not the cache's")
    with cache.accounting.hold():
        pass
    assert not list((cache.data / "tmp").iterdir()) and not (cache.data / SHA / "bin").exists()
    assert (cache.data / "mine.txt").exists()
    assert consistent(cache)
    assert cache.read(key_of(data), 0, len(data), Source(data)) == data


def test_a_process_opening_the_cache_while_another_repairs_it_is_never_refused(tmp_path):
    """A repair (the first lock holder of a run) empties tmp/ and keeps it: a process checking the folder meanwhile
    found it missing, or a file, and was refused as if the folder were not writable."""
    settings = CacheSettings(tmp_path / "cache", 1 << 30)
    create(settings.folder, BLOCK)
    done = threading.Event()

    def repairing():
        while not done.is_set():
            repair(settings.data, BLOCK, None)

    thread = threading.Thread(target=repairing)
    thread.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            assert checked(settings, BLOCK) == BLOCK
    finally:
        done.set()
        thread.join()


def test_bad_configuration_is_one_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match=r"cannot be written there .*writable --cache-dir"):
        BlockCache(CacheSettings(tmp_path / "file" / "cache", 1 << 30))
    with pytest.raises(CacheError, match=r"holds fewer than 4 blocks .*give at least 4,247,552"):
        BlockCache(CacheSettings(tmp_path / "cache", 3 << 20))
    (tmp_path / "other" / "data").mkdir(parents=True)
    (tmp_path / "other" / "data" / "cache.json").write_text('{"format": 99}')
    with pytest.raises(CacheError, match="not a data cache of this mmidx version"):
        BlockCache(CacheSettings(tmp_path / "other", 1 << 30))
    with pytest.raises(CacheError, match="not a size in bytes"):
        parse_size("lots")


def test_a_full_disk_falls_back_to_uncached_reads_saying_so_once(tmp_path, monkeypatch, capfd):
    data = blob_of(40_000)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, 1 << 20)

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(block_cache.os, "replace", full)
    for start in range(0, 40_000, 7_000):
        assert cache.read(key, start, start + 7_000, source) == data[start:start + 7_000]
    assert capfd.readouterr().err.count("No space left on device") == 1
    monkeypatch.undo()
    assert consistent(opened(tmp_path, 1 << 20)) and not list((cache.data / "tmp").iterdir())  # the next repairs


def test_sizes_and_settings_from_options_and_environment(tmp_path, monkeypatch):
    assert [parse_size(t) for t in ("1000", "2K", "1.5G", "64MiB", "3TB", 7)] == [1000, 2000, 1_500_000_000,
                                                                                 64 << 20, 3 * 10**12, 7]
    monkeypatch.setenv("MMIDX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MMIDX_CACHE_LIMIT", "20G")
    assert cache_settings() == CacheSettings(tmp_path, 20 * 10**9)
    assert cache_settings(tmp_path / "x", 0) == CacheSettings(tmp_path / "x", None)  # 0: no data cache
    monkeypatch.setenv("MMIDX_CACHE_LIMIT", "big")
    with pytest.raises(CacheError, match="MMIDX_CACHE_LIMIT: 'big' is not a size"):
        cache_settings()


def test_cache_info_and_clear_one_dataset_then_everything_keeping_other_files(tmp_path):
    first, second = blob_of(30_000, 1), blob_of(20_000, 2)
    cache = opened(tmp_path, 1 << 20)
    cache.read(key_of(first, "01" * 32), 0, 30_000, Source(first))
    cache.read(FileKey("02" * 32, "bin", "s3://b/other.bin", "s3://b/other", 20_000), 0, 20_000, Source(second))
    cache.flush()
    (cache.data / "notes.txt").write_text("mine")
    info = cache_info(tmp_path / "cache")
    # a whole 4 KiB block and its header take two pages; a last block of a few bytes, one
    assert info["datasets"] == {"s3://bucket/ds": {"versions": 1, "blocks": 8, "bytes": 7 * 8192 + 4096},
                                "s3://b/other": {"versions": 1, "blocks": 5, "bytes": 4 * 8192 + 4096}}
    assert info["run"]["misses"] == 13 and info["bytes"] == folder_bytes(cache.data)
    assert clear_cache(tmp_path / "cache", "s3://bucket/ds?endpoint_override=x") >= 7 * 8192 + 4096
    assert list(cache_info(tmp_path / "cache")["datasets"]) == ["s3://b/other"]
    clear_cache(tmp_path / "cache")
    assert cache_info(tmp_path / "cache")["datasets"] == {}
    assert (cache.data / "notes.txt").read_text() == "mine"
    assert consistent(cache)


class Items:
    """A pack index stand-in: pack k holds samples drawn at random from 60, of one dataset."""

    def __init__(self, packs, seed=0):
        rng = np.random.default_rng(seed)
        self.samples = [rng.choice(60, 5, replace=False).tolist() for _ in range(packs)]

    def __len__(self):
        return len(self.samples)

    def items(self, pack):
        from mmidx.index.pack_index import PackItem

        return [PackItem(0, 0, sample, 0) for sample in self.samples[pack]]


def sample_bytes(group, dataset, samples):
    """Sample s holds bytes [3000 s, 3000 s + 2500) of one file."""
    return {("f", "images"): (samples * 3000, samples * 3000 + 2500, np.arange(len(samples)))}


def test_next_use_answers_as_a_scan_of_the_whole_run_however_far_its_window_has_moved():
    packs = Items(700)
    policy = NextUse(packs, sample_bytes, lambda step: [step], range(700), lambda pack: pack, BLOCK, 10**9)
    blocks_of = [{block for sample in packs.samples[step] for block in range(3000 * sample // BLOCK,
                                                                            (3000 * sample + 2499) // BLOCK + 1)}
                 for step in range(700)]

    def scanned(block, after):
        return next((step for step in range(after, 700) if block in blocks_of[step]), NEVER)

    blocks = np.arange(0, 60 * 3000 // BLOCK + 1)
    for now in (0, 5, 200, 300, 555, 699):
        policy.at(now, now + 3)
        assert policy.next_use(("f", "images"), blocks, None).tolist() == [scanned(b, now + 3) for b in blocks]
        assert policy.next_use(("f", "images"), blocks, now + 1).tolist() == [scanned(b, now + 2) for b in blocks]
    short = NextUse(packs, sample_bytes, lambda step: [step], range(700), lambda pack: pack, BLOCK, 4 * BLOCK)
    for now in range(0, 700, 37):  # a window of one chunk, rebuilt as the steps pass its middle
        short.at(now)
        found = short.next_use(("f", "images"), blocks, None).tolist()
        assert now in short.window and len(short.window) <= 256
        assert found == [step if (step := scanned(b, now)) < short.window.stop else NEVER for b in blocks]
    idle = NextUse(packs, sample_bytes, lambda step: [step], range(700), lambda pack: pack, BLOCK, 10**9)
    for now in range(0, 700, 37):
        idle.at(now)
    assert not idle.window  # never asked (a cache that never evicts): the window was never built
