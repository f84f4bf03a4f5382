"""The node's data cache against what stalls, kills or misleads it: a reader stopped while it holds the folder's lock
and another user's ``flock`` delay a reader by the lock's wait at most, which then reads uncached saying who holds
it; role arrays truncated in place kill no reader; a state.json no holder could have written is recounted and the
folder stays within its limit; a limit of exactly the smallest accepted stores blocks, and one below it, or of
less than a byte, is one clear error; a store that fails is said when it happens and when the process ends; two
threads missing the same cold block fetch it once. Every wait is bounded."""

import multiprocessing
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mmidx.io import cache_accounting
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.cache_folder import (
    CacheError,
    CacheSettings,
    cache_settings,
    create,
    folder_bytes,
    parse_size,
    read_state,
    smallest_limit,
)

BLOCK = 4096
SHA = "ab" * 32
WAIT = 0.5  # the lock's wait in these tests (30 s in use)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}


def blob_of(size, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class Source:
    """A remote file stood in for by bytes: ``fetch(a, b)`` as RemoteFile's ranged request, counted; ``delay``
    seconds a request, so that concurrent reads overlap."""

    def __init__(self, data, delay=0.0):
        self.data, self.delay, self.calls = data, delay, []
        self._lock = threading.Lock()

    def __call__(self, start, stop):
        with self._lock:
            self.calls.append((start, stop))
        time.sleep(self.delay)
        return self.data[start:stop]

    @property
    def fetched(self):
        return sum(stop - start for start, stop in self.calls)


def key_of(data, sha=SHA, role="images"):
    return FileKey(sha, role, f"s3://bucket/ds.{role}", "s3://bucket/ds", len(data))


def opened(tmp_path, limit, block=BLOCK):
    return BlockCache(CacheSettings(tmp_path / "cache", limit), block_size=block)


def in_time(function, seconds):
    """``function()`` in a thread: its result, or a failure if it has not returned within ``seconds`` (it stalled)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"stalled for more than {seconds} s"
    assert result, "failed (see the thread's traceback above)"
    return result[0]


def state_of(pid):
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def until(condition, seconds=10):
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "not within the test's bound"
        time.sleep(0.01)


HOLDER = """
import os, signal, sys
from pathlib import Path
from mmidx.io.cache_accounting import Accounting
with Accounting(Path(sys.argv[1]), int(sys.argv[2])).hold():
    print("holding", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)  # Ctrl-Z, scontrol suspend, a debugger's breakpoint
"""


def reads_of(tmp_path, data, source):
    """What a reader of the node does meanwhile: open the cache, read the whole file twice."""
    def read():
        cache = opened(tmp_path, 1 << 20)
        return [bytes(cache.read(key_of(data), 0, len(data), source)) for _ in range(2)]
    return read


@pytest.mark.skipif(not Path("/proc/locks").exists(), reason="the holder's pid is read from /proc/locks (Linux)")
def test_a_reader_stopped_while_it_holds_the_lock_delays_another_by_the_wait_at_most(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(cache_accounting, "LOCK_WAIT_S", WAIT)
    create(tmp_path / "cache", BLOCK)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path / "cache" / "data"), str(BLOCK)],
                              stdout=subprocess.PIPE, env=ENV)
    try:
        assert holder.stdout.readline() == b"holding\n"
        until(lambda: state_of(holder.pid) == "T")
        data, started = blob_of(30_000), time.monotonic()
        source = Source(data)
        assert in_time(reads_of(tmp_path, data, source), 20) == [data, data]
        assert time.monotonic() - started < 10 * WAIT  # one wait (the open's), not one per read
        assert source.fetched == 2 * len(data)  # uncached: nothing stored
        lines = capfd.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and re.search(rf"lock is held by pid {holder.pid} \(\S+, stopped\) for more than "
                                             rf"{WAIT:g} s; this process stores nothing more there", lines[0])
    finally:
        holder.kill()
        holder.wait()
    cache = opened(tmp_path, 1 << 20)  # the holder gone, the next reader repairs what it left busy and caches
    assert cache.read(key_of(data), 0, len(data), source) == data and source.fetched == 3 * len(data)
    assert cache.read(key_of(data), 0, len(data), source) == data and source.fetched == 3 * len(data)


@pytest.mark.skipif(shutil.which("flock") is None, reason="needs util-linux's flock command")
@pytest.mark.parametrize("name", ["lock", "users"])
def test_another_users_flock_of_a_lock_file_delays_a_reader_by_the_wait_at_most(tmp_path, monkeypatch, capfd, name):
    monkeypatch.setattr(cache_accounting, "LOCK_WAIT_S", WAIT)
    create(tmp_path / "cache", BLOCK)
    path = tmp_path / "cache" / "data" / name
    path.touch()
    holder = subprocess.Popen(["flock", "-x", str(path), "sleep", "60"])
    try:
        until(lambda: f" {holder.pid} " in Path("/proc/locks").read_text())
        data = blob_of(30_000)
        assert in_time(reads_of(tmp_path, data, Source(data)), 20) == [data, data]
        error = capfd.readouterr().err
        assert f"{path} is held by pid {holder.pid} (flock) for more than {WAIT:g} s" in error
        assert error.count("stores nothing more") == 1
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_files_are_their_owners_alone_or_a_group_writable_folders_group(tmp_path):
    create(tmp_path / "cache", BLOCK)
    data = tmp_path / "cache" / "data"
    (data / "users").touch(mode=0o644)  # made by an older mmidx
    os.chmod(data / "users", 0o644)
    opened(tmp_path, 1 << 20)
    assert {name: (data / name).stat().st_mode & 0o777 for name in ("lock", "users")} == {"lock": 0o600,
                                                                                          "users": 0o600}
    create(tmp_path / "shared", BLOCK)
    os.chmod(tmp_path / "shared" / "data", 0o2770)  # a cache the users of a group share (docs/guide/storage.md)
    BlockCache(CacheSettings(tmp_path / "shared", 1 << 20), block_size=BLOCK)
    assert {(tmp_path / "shared" / "data" / name).stat().st_mode & 0o777 for name in ("lock", "users")} == {0o660}


TRUNCATED = """
import os, sys
import numpy as np
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.cache_folder import CacheSettings
data = np.random.default_rng(0).integers(0, 256, 1000 * 4096, dtype=np.uint8).tobytes()  # arrays of two pages
key = FileKey("ab" * 32, "images", "s3://b/ds.images", "s3://b/ds", len(data))
cache = BlockCache(CacheSettings(sys.argv[1], 160_000), block_size=4096)  # 20 blocks: evictions
fetch = lambda a, b: data[a:b]
ranges = [(start, start + 30_000) for start in (0, 5_000, 3_900_000, 3_990_000, 2_000_000, 12_000)]
for start, stop in ranges[:4]:  # stored, the arrays open
    assert cache.read(key, start, stop, fetch) == data[start:stop]
role = f"{cache.data}/{key.sha}/{key.role}"
os.truncate(role + ".present", int(sys.argv[2]))  # in place: the same files, shorter
os.truncate(role + ".used", int(sys.argv[2]))
for start, stop in ranges * 2:  # kept blocks, entries read back, new blocks stored, evictions
    assert cache.read(key, start, stop, fetch) == data[start:stop], start
cache.flush()
print("read", flush=True)
"""


@pytest.mark.parametrize("length", [0, 100])
def test_role_arrays_truncated_in_place_kill_no_reader_and_are_rebuilt(tmp_path, length):
    create(tmp_path / "cache", BLOCK)
    ran = subprocess.run([sys.executable, "-c", TRUNCATED, str(tmp_path / "cache"), str(length)], env=ENV,
                         capture_output=True, text=True, timeout=120)
    assert (ran.returncode, ran.stdout) == (0, "read\n"), (ran.returncode, ran.stderr[-2000:])  # SIGBUS: -7
    present = tmp_path / "cache" / "data" / SHA / "images.present"
    assert present.stat().st_size == 8 * 1000  # rebuilt whole by the next store
    state = read_state(tmp_path / "cache" / "data")
    assert state["bytes"] == folder_bytes(tmp_path / "cache" / "data") and not state["busy"]


def _fill(folder, limit, done):
    data = blob_of(60 * BLOCK, 1)
    cache = BlockCache.of(CacheSettings(folder, limit))
    cache.read(key_of(data, "cd" * 32), 0, len(data), Source(data))
    cache.flush()
    done.put("ok")


@pytest.mark.parametrize("counted", [-10**9, 1, "a third"])
def test_a_state_no_holder_could_have_written_is_recounted_and_the_folder_stays_within_its_limit(tmp_path, counted):
    folder, limit = tmp_path / "cache", 70 * 2 * BLOCK
    create(folder, BLOCK)
    done = multiprocessing.get_context("fork").Queue()
    filler = multiprocessing.get_context("fork").Process(target=_fill, args=(folder, limit, done))  # the last run
    filler.start()
    assert done.get(timeout=60) == "ok"
    filler.join(60)
    state = read_state(folder / "data")
    state["bytes"] = state["bytes"] // 3 if counted == "a third" else counted  # edited, or a bug's
    (folder / "data" / "state.json").write_text(__import__("json").dumps(state))
    data = blob_of(150 * BLOCK, 2)
    cache = BlockCache.of(CacheSettings(folder, limit))  # a new run
    peak = 0
    for start in range(0, len(data), 5 * BLOCK):
        assert cache.read(key_of(data), start, start + 5 * BLOCK, Source(data)) == data[start:start + 5 * BLOCK]
        peak = max(peak, folder_bytes(folder / "data"))
    cache.flush()
    assert peak <= limit, f"the folder grew to {peak / limit:.2f}x its limit"
    assert read_state(folder / "data")["bytes"] == folder_bytes(folder / "data")


def test_a_limit_of_exactly_the_smallest_accepted_stores_blocks_and_one_byte_less_is_refused(tmp_path):
    data = blob_of(4 * BLOCK)
    source, key = Source(data), key_of(data)
    cache = opened(tmp_path, smallest_limit(BLOCK))
    assert cache.read(key, 0, len(data), source) == data
    assert cache.read(key, 0, len(data), source) == data and len(source.calls) == 1  # all four stored
    assert sorted(path.name for path in (cache.data / SHA / "images").iterdir()) == ["0", "1", "2", "3"]
    assert folder_bytes(cache.data) == smallest_limit(BLOCK)
    with pytest.raises(CacheError, match=rf"cache limit {smallest_limit(BLOCK) - 1:,} bytes holds fewer than 4 blocks "
                                         rf"of 4,096 with the cache's own files: give at least "
                                         rf"{smallest_limit(BLOCK):,}"):
        opened(tmp_path, smallest_limit(BLOCK) - 1)
    assert smallest_limit(1 << 20) == 4 * ((1 << 20) + 4096) + 9 * 4096  # the guide's figure for 1 MiB blocks


@pytest.mark.parametrize("text", ["0.5", "0.0001K", "0.0000000001G"])
def test_a_limit_of_less_than_a_byte_is_refused_not_taken_for_no_cache(text, monkeypatch, capsys):
    with pytest.raises(CacheError, match=rf"'{re.escape(text)}' is less than one byte: .* or 0 to turn the data "
                                         "cache off"):
        parse_size(text)
    monkeypatch.setenv("MMIDX_CACHE_LIMIT", text)
    with pytest.raises(CacheError, match=r"MMIDX_CACHE_LIMIT: .* is less than one byte"):
        cache_settings()
    from mmidx.cli import main

    with pytest.raises(SystemExit):
        main(["sample", "s3://bucket/ds", "0", "--cache-limit", text])
    assert "is less than one byte" in capsys.readouterr().err
    assert [parse_size(zero) for zero in ("0", "0.0", "0G")] == [0, 0, 0]  # 0 still turns the cache off


FULL_DISK = """
import os, sys
import numpy as np
from mmidx.io import block_store
from mmidx.io.block_cache import BlockCache, FileKey
from mmidx.io.cache_folder import CacheSettings
data = np.random.default_rng(0).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
key = FileKey("ab" * 32, "images", "s3://b/ds.images", "s3://b/ds", len(data))
cache = BlockCache(CacheSettings(sys.argv[1], 1 << 20), block_size=4096)
def full(*args):
    raise OSError(28, "No space left on device")
block_store.os.replace = full
for start in range(0, len(data), 9_000):
    assert cache.read(key, start, start + 9_000, lambda a, b: data[a:b]) == data[start:start + 9_000]
print("read", flush=True)
"""


def test_a_store_that_fails_is_said_when_it_happens_and_again_when_the_process_ends(tmp_path):
    create(tmp_path / "cache", BLOCK)
    ran = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path / "cache")], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert (ran.returncode, ran.stdout) == (0, "read\n"), ran.stderr
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert "cannot store a block: No space left on device; this process stores nothing more there" in lines[0]
    assert re.search(r"this process stored nothing there from \d\d:\d\d:\d\d on \(cannot store a block: No space "
                     r"left on device\)$", lines[1])


def test_threads_missing_the_same_cold_blocks_fetch_each_once(tmp_path):
    data = blob_of(8 * BLOCK)
    source, key = Source(data, delay=0.2), key_of(data)
    cache = opened(tmp_path, 1 << 20)
    start = threading.Barrier(3)
    ranges = [(0, 8 * BLOCK), (2 * BLOCK + 5, 5 * BLOCK), (BLOCK, 8 * BLOCK - 1)]  # overlapping, cold

    def read(a, b):
        start.wait()
        return bytes(cache.read(key, a, b, source))

    outs = [[] for _ in ranges]
    readers = [threading.Thread(target=lambda a=a, b=b, out=out: out.append(read(a, b)))
               for (a, b), out in zip(ranges, outs, strict=True)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join(20)
    assert outs == [[data[a:b]] for a, b in ranges]
    assert source.fetched == len(data)  # each block once (three threads fetched 2.4x that before)
    cache.flush()
    run = read_state(cache.data)["run"]
    assert run["bytes_fetched"] == len(data) and run["bytes_from_cache"] == 0


def test_a_thread_waiting_for_a_fetch_that_fails_fetches_the_block_itself(tmp_path):
    data = blob_of(4 * BLOCK)
    key, calls, started = key_of(data), [], threading.Event()

    def failing(a, b):
        calls.append("first")
        started.set()
        time.sleep(0.3)
        raise OSError("the store reset the connection")

    def working(a, b):
        calls.append("second")
        return data[a:b]

    cache, errors, read = opened(tmp_path, 1 << 20), [], []
    def fails():
        with pytest.raises(OSError, match="reset the connection"):
            cache.read(key, 0, len(data), failing)
        errors.append("raised")

    first = threading.Thread(target=fails)
    first.start()
    started.wait(10)
    second = threading.Thread(target=lambda: read.append(bytes(cache.read(key, 0, len(data), working))))
    second.start()
    first.join(10)
    second.join(10)
    assert errors and read == [data] and calls == ["first", "second"]
