"""The data cache of remote datasets on moto's S3 server (127.0.0.1): with a limit above the dataset a second
epoch reads every byte from the cache with the server stopped; with a third of the dataset the batches equal the
local copy's, the folder stays within its limit while the loader's processes share it, and eviction by next use
hits at least as often as LRU on the same trace; the commands take --cache-dir and --cache-limit, and
``mmidx cache info`` and ``clear`` report and empty the cache."""

import logging
import os
import pickle
import random
import re
import socket
import subprocess
import sys
import threading
import time

import boto3
import numpy as np
import pytest
from support.packing import VAE, config_of
from support.packs import assert_same_batches

from mmidx.cli import main
from mmidx.index.pack_index import build_pack_index
from mmidx.ingest.writer import DatasetBuilder
from mmidx.io.block_cache import BlockCache
from mmidx.io.block_store import NEVER
from mmidx.io.cache_folder import CacheError, CacheSettings, create, folder_bytes, read_state, smallest_limit
from mmidx.io.storage import StorageError
from mmidx.pack.builder import PackBuilder
from mmidx.read import next_use
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.next_use import block_uses, simulate
from mmidx.read.prefetch import PackPrefetcher
from mmidx.sources.elements import Element, StoredImage
from mmidx.toolkit.synthetic import photo_jpeg
from mmidx.train.loader import NodeSchedule, PackDataset, PackLoader

BLOCK = 16 << 10
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}


def write_t2i(prefix, samples):
    """Captions and photo-like JPEGs of 96-200 px (a few kB each), as t2i data."""
    rng, pick = np.random.default_rng(0), random.Random(0)
    with DatasetBuilder(prefix, vocab_size=1000, special_tokens=SPECIAL) as builder:
        for _ in range(samples):
            width, height = pick.randrange(96, 200), pick.randrange(96, 200)
            image = StoredImage(photo_jpeg(pick, width, height, 85), width, height, "JPEG", "RGB")
            builder.add_sample([rng.integers(10, 1000, rng.integers(5, 30)).tolist()], [image],
                               [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]])
        builder.finalize()


@pytest.fixture(scope="module")
def stored(s3, tmp_path_factory):
    """A t2i dataset of 150 samples (about 1 MB), on disk and uploaded."""
    folder = tmp_path_factory.mktemp("cached")
    write_t2i(folder / "t2i", 150)
    uri = s3.upload(folder / "t2i", "s3://mmidx/cached/t2i")
    data = sum((folder / f"t2i{suffix}").stat().st_size for suffix in (".bin", ".images"))
    return {"local": str(folder / "t2i"), "remote": uri, "bytes": data}


SMALL_PACKS = {"max_num_tokens": 450, "expected_num_tokens": 300, "max_num_tokens_per_sample": 450,
               "prefer_buffer_before": 150, "max_buffer_size": 4}  # 94 steps of 2-5 samples: a step reads 2-10 blocks


def packs_of(prefix, epochs=3, **overrides):
    config = config_of({"t2i": {"datasets": [prefix], "image_transform_args": VAE}}, **overrides)
    return PackDataset(build_pack_index(config, num_samples=150 * epochs, progress=False), PackBuilder(config))


def comparable(batches):
    """BAGEL's dicts of ``batches`` without where each sample was read (dataset location, worker)."""
    found = []
    for batch in batches:
        data = batch.to_dict()
        data["batch_data_indexes"] = [{k: v for k, v in entry.items() if k not in ("dataset", "worker_id")}
                                      for entry in data["batch_data_indexes"]]
        found.append(data)
    return found


@pytest.fixture(scope="module")
def local_batches(stored):
    return comparable(PackLoader(packs_of(stored["local"]), global_batch_size=1))


def cache_at(folder, limit, monkeypatch):
    """A fresh cache folder of BLOCK-sized blocks, which every reader of the test uses (the variables)."""
    create(folder, BLOCK)
    monkeypatch.setenv("MMIDX_CACHE_DIR", str(folder))
    monkeypatch.setenv("MMIDX_CACHE_LIMIT", str(limit))
    return folder / "data"


class Sampler:
    """The folder's size, sampled in a thread while the block runs: ``peak`` and how many samples."""

    def __init__(self, folder):
        self.folder, self.peak, self.samples = folder, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self):
        while not self._stop.is_set():
            self.peak, self.samples = max(self.peak, folder_bytes(self.folder)), self.samples + 1
            time.sleep(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_with_the_dataset_cached_a_second_epoch_reads_every_byte_from_the_cache_with_the_server_stopped(
        s3, stored, local_batches, tmp_path, monkeypatch):
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # this test's own, to stop
    server.start()
    host, port = server.get_host_and_port()
    client = boto3.client("s3", endpoint_url=f"http://{host}:{port}")
    client.create_bucket(Bucket="private")
    for suffix in (".meta.json", ".idx", ".bin", ".plan", ".images"):
        client.upload_file(stored["local"] + suffix, "private", "t2i" + suffix)
    data = cache_at(tmp_path / "cache", 2 * stored["bytes"] + (1 << 20), monkeypatch)
    remote = packs_of(f"s3://private/t2i?endpoint_override={host}:{port}&scheme=http")
    first = comparable(PackLoader(remote, global_batch_size=1, num_workers=2))
    fetched = read_state(data)["run"]["bytes_fetched"]
    server.stop()
    second = comparable(PackLoader(remote, global_batch_size=1, num_workers=2))
    assert_same_batches(first, local_batches)
    assert_same_batches(second, local_batches)
    run = read_state(data)["run"]
    assert stored["bytes"] <= fetched and run["bytes_fetched"] == run["misses"] == 0 and run["hits"] > 0
    # A process that unpickles the dataset (spawned workers, Ray tasks) opens the version its parent opened, from
    # the cached small files, with no request either.
    unpickled, local = pickle.loads(pickle.dumps(remote.builder.datasets[0][0])), MMIDXDataset(stored["local"])
    assert [bytes(unpickled[i].image(0).data) for i in range(150)] == [bytes(local[i].image(0).data)
                                                                      for i in range(150)]


def test_with_a_third_of_the_dataset_batches_equal_local_ones_and_the_folder_stays_within_its_limit(
        stored, local_batches, tmp_path, monkeypatch):
    limit = stored["bytes"] // 3
    data = cache_at(tmp_path / "cache", limit, monkeypatch)
    with Sampler(data) as sampler:
        batches = comparable(PackLoader(packs_of(stored["remote"]), global_batch_size=1, num_workers=2))
    assert_same_batches(batches, local_batches)
    run = read_state(data)["run"]
    assert sampler.samples > 10 and 0 < sampler.peak <= limit
    assert run["evicted"] > 0 and run["hits"] > 0
    assert read_state(data)["bytes"] == folder_bytes(data)


def hit_rate(run):
    return run["bytes_from_cache"] / (run["bytes_from_cache"] + run["bytes_fetched"])


def test_eviction_by_next_use_hits_at_least_as_often_as_lru_on_the_same_trace(stored, tmp_path, monkeypatch, capfd):
    """In the regime the guide asks for (a limit above a step's blocks, here a third of the dataset), next use
    hits more often than LRU, simulated and measured. (Below one step's blocks most reads bypass the cache and
    the measured rates depend on the fetch threads' timing, so that regime is not compared.)"""
    limit = stored["bytes"] // 3
    packs = packs_of(stored["remote"], packing=SMALL_PACKS)
    loader = PackLoader(packs, global_batch_size=1)
    schedule = NodeSchedule(loader.sampler())
    ranges = PackPrefetcher(packs.packs, packs.builder.datasets).ranges
    uses = block_uses(packs.packs, schedule.steps, schedule, ranges, BLOCK)
    largest_step = max(np.bincount((np.concatenate(list(uses.values())) % next_use.STEP).astype(np.int64)))
    assert 3 * largest_step * BLOCK <= 2 * limit  # the largest step's blocks fit one and a half times
    sizes = {file.key[:2]: file.size for file in packs.builder.datasets[0][0].remote_files.values()}
    simulated = {policy: simulate(uses, sizes, BLOCK, limit, policy)["hit_rate"] for policy in ("next-use", "lru")}
    measured = {}
    for policy in ("next-use", "lru"):  # the loader in this process: one cache, the same trace each time
        data = cache_at(tmp_path / policy, limit, monkeypatch)
        if policy == "lru":  # the same cache without the schedule: no block is read ahead
            monkeypatch.setattr(next_use.NextUse, "next_use", lambda self, key, blocks, pack: np.full(len(blocks),
                                                                                                 NEVER))
        list(PackLoader(packs_of(stored["remote"], packing=SMALL_PACKS), global_batch_size=1))
        BlockCache.of(CacheSettings(tmp_path / policy, limit)).flush()
        measured[policy] = hit_rate(read_state(data)["run"])
    assert "bytes of blocks step" not in capfd.readouterr().err
    # Measured on a 2-core host, 3 runs: next use 0.39-0.40 against LRU 0.27-0.28 (simulated 0.50 and 0.25: the
    # cache keeps headroom and is read a few steps ahead of the simulated replay).
    assert simulated["next-use"] > simulated["lru"] + 0.1
    assert measured["next-use"] > measured["lru"] + 0.05


def test_a_limit_below_a_steps_blocks_says_so_once_and_batches_stay_right(stored, local_batches, tmp_path,
                                                                         monkeypatch, capfd):
    cache_at(tmp_path / "cache", smallest_limit(BLOCK), monkeypatch)
    batches = comparable(PackLoader(packs_of(stored["remote"]), global_batch_size=1))
    assert_same_batches(batches, local_batches)
    assert capfd.readouterr().err.count("bytes of blocks step") == 1


def test_commands_take_the_cache_options_and_cache_info_and_clear_report_and_empty_it(s3, stored, tmp_path, capsys):
    folder = tmp_path / "cache"
    command = [sys.executable, "-m", "mmidx.cli", "sample", stored["remote"], "3", "--cache-dir", str(folder),
               "--cache-limit", "64MiB"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    assert subprocess.run(command, env=env, capture_output=True, text=True).returncode == 0
    (folder / "data" / "notes.txt").write_text("not the cache's")
    assert main(["cache", "info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "s3://mmidx/cached/t2i  1 version" in out and "last run" in out and "misses" in out
    assert main(["cache", "info", str(folder), "--json"]) == 0
    assert capsys.readouterr().out.count('"blocks"') == 1
    assert main(["cache", "clear", str(folder), "--dataset", "s3://mmidx/cached/other"]) == 0
    assert "s3://mmidx/cached/t2i" in main_output(["cache", "info", str(folder)], capsys)
    assert main(["cache", "clear", str(folder)]) == 0
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")) == ["data", "data/notes.txt"]
    (folder / "data" / "notes.txt").unlink()
    assert main(["cache", "clear", str(folder)]) == 0 and not (folder / "data").exists()


def main_output(argv, capsys):
    assert main(argv) == 0
    return capsys.readouterr().out


def test_a_cache_a_reader_cannot_use_is_one_line_when_it_opens_the_dataset(s3, stored, tmp_path, capsys):
    with pytest.raises(CacheError, match=r"fewer than 4 blocks of 1,048,576 with the cache's own files: give at least"):
        MMIDXDataset(stored["remote"], cache_dir=tmp_path, cache_limit="1M")
    (tmp_path / "file").write_text("")
    assert main(["sample", stored["remote"], "0", "--cache-dir", str(tmp_path / "file"), "--cache-limit", "1G"]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "the data cache cannot be written there" in error


def small_file_copy(folder, dataset, role):
    """Where the cache folder ``folder`` keeps ``dataset``'s copy of its file ``role``."""
    from mmidx.format import SUFFIXES

    return folder / "remote" / dataset.metadata["meta_sha256"] / f"dataset{SUFFIXES[role]}"


def same_samples(dataset, local):
    """Every sample's texts, plan and images are the local copy's."""
    assert len(dataset) == len(local)
    for ours, theirs in zip(dataset, local, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(ours.texts, theirs.texts, strict=True))
        assert [ours.sequence_plan(view) for view in range(ours.num_views)] == \
            [theirs.sequence_plan(view) for view in range(theirs.num_views)]
        assert [bytes(a.data) for a in ours.images] == [bytes(b.data) for b in theirs.images]


@pytest.mark.parametrize("role", ["idx", "plan", "meta"])
def test_a_one_bit_change_in_a_cached_small_file_is_caught_when_a_process_opens_it(stored, tmp_path, capfd, role):
    """A bit flipped in the node's copy of a small file (a loss bit of the .plan, an index entry) changed what every
    reader of the node trained on: each open checks the copies it maps, says which one differs and fetches it again.
    (The metadata is downloaded at every open; a loader worker reads its parent's version from the copy.)"""
    folder, local = tmp_path / "cache", MMIDXDataset(stored["local"])
    dataset = MMIDXDataset(stored["remote"], cache_dir=folder)
    copy = small_file_copy(folder, dataset, role)
    original = copy.read_bytes()
    damaged = bytearray(original)
    damaged[34 if role == "idx" else len(damaged) // 2] ^= 1  # the .idx: the first text's length, after the header
    copy.write_bytes(bytes(damaged))
    capfd.readouterr()
    opened = pickle.loads(pickle.dumps(dataset)) if role == "meta" else MMIDXDataset(stored["remote"], cache_dir=folder)
    same_samples(opened, local)
    assert copy.read_bytes() == original
    error = capfd.readouterr().err.strip()
    assert error.startswith(f"mmidx: {copy}: ") and error.endswith(": fetched again") and "\n" not in error
    assert f"this node's cached copy of {stored['remote']}" in error


def test_verify_of_a_remote_dataset_hashes_the_nodes_copies_and_says_which(stored, tmp_path, capsys):
    folder = tmp_path / "cache"
    command = ["verify", stored["remote"], "--cache-dir", str(folder)]
    assert main(command) == 0
    copies = folder / "remote" / MMIDXDataset(stored["remote"], cache_dir=folder).metadata["meta_sha256"]
    assert capsys.readouterr().out.strip() == (
        f"{stored['remote']}: OK (checksums and structure verified, image headers probed; the checksums of the "
        f"objects in storage and of this node's copies of the small files in {copies})")
    plan = copies / "dataset.plan"
    raw = bytearray(plan.read_bytes())
    raw[len(raw) // 2] ^= 1
    plan.write_bytes(bytes(raw))
    assert main(command) == 1
    error = capsys.readouterr().err.strip()
    assert error == (f"FAIL {plan}: this node's cached copy of {stored['remote']}.plan differs from its xxh3_128 "
                     "checksum or size (changed on this disk): fetched again, and checked")
    assert main(command) == 0 and "OK" in capsys.readouterr().out  # the copy fetched again is sound


def cached_whole(stored, folder):
    """Every sample of the dataset read once through a data cache that holds it all (its every block stored)."""
    create(folder, BLOCK)
    dataset = MMIDXDataset(stored["remote"], cache_dir=folder, cache_limit=4 * stored["bytes"])
    for sample in dataset:
        sample.images, sample.texts  # noqa: B018 (the reads are the point)
    return dataset


def unreachable(stored):
    """The dataset's URI with a query naming a closed port: any request to the store would fail."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"{stored['remote']}?endpoint_override=127.0.0.1:{port}&scheme=http"


def test_a_dataset_whose_every_byte_is_cached_opens_offline_with_the_store_unreachable(stored, tmp_path, capfd):
    folder, local = tmp_path / "cache", MMIDXDataset(stored["local"])
    cached_whole(stored, folder)
    uri = unreachable(stored)
    with pytest.raises(StorageError, match="cannot reach the storage endpoint"):  # online: the store is asked
        MMIDXDataset(uri, cache_dir=folder, cache_limit=4 * stored["bytes"])
    offline = MMIDXDataset(uri, cache_dir=folder, cache_limit=4 * stored["bytes"], cache_offline=True)
    same_samples(offline, local)
    same_samples(pickle.loads(pickle.dumps(offline)), local)  # a worker: offline too
    assert "mmidx:" not in capfd.readouterr().err
    with pytest.MonkeyPatch.context() as patch:  # the variable, as --cache-offline sets it for every reader
        patch.setenv("MMIDX_CACHE_OFFLINE", "1")
        patch.setenv("MMIDX_CACHE_DIR", str(folder))
        patch.setenv("MMIDX_CACHE_LIMIT", str(4 * stored["bytes"]))
        batches = comparable(PackLoader(packs_of(uri, epochs=1), global_batch_size=1, num_workers=2))
    assert_same_batches(batches, comparable(PackLoader(packs_of(stored["local"], epochs=1), global_batch_size=1)))
    plan = small_file_copy(folder, offline, "plan")  # offline, a damaged copy cannot be fetched again: refused
    plan.write_bytes(plan.read_bytes()[:-1] + bytes([plan.read_bytes()[-1] ^ 1]))
    with pytest.raises(StorageError, match=rf"^{re.escape(str(plan))}: this node's cached copy of .* differs .* "
                                           "cannot be opened offline"):
        MMIDXDataset(uri, cache_dir=folder, cache_limit=4 * stored["bytes"], cache_offline=True)


def test_offline_a_block_missing_from_the_cache_is_one_line_naming_it(stored, tmp_path):
    folder = tmp_path / "cache"
    dataset = cached_whole(stored, folder)
    uri, key = unreachable(stored), dataset.remote_files["images"].key
    (folder / "data" / key.sha / "images" / "5").unlink()  # evicted by another process since (its stamp left)
    present = folder / "data" / key.sha / "images.present"
    stamps = np.fromfile(present, dtype=np.uint64)
    stamps[3] = 0  # and block 3 evicted as the cache does
    stamps.tofile(present)
    with pytest.raises(StorageError) as raised:
        MMIDXDataset(uri, cache_dir=folder, cache_limit=4 * stored["bytes"], cache_offline=True)
    message = str(raised.value)
    assert message.startswith(f"{uri.split('?')[0]}.images?") and "\n" not in message
    assert ": block 3 is not in this node's cache" in message and "cache_offline=True never asks the store" in message
    stamps[3] = 1
    stamps.tofile(present)  # listed, but its entry gone: the read that needs it says so (in a process that does not
    offline = MMIDXDataset(uri, cache_dir=folder, cache_limit=4 * stored["bytes"] + 1, cache_offline=True)  # keep it
    images = offline.remote_files["images"]
    with pytest.raises(StorageError, match=r"images\?.*: block 5 is not in this node's cache"):
        images[5 * BLOCK:6 * BLOCK]
    with pytest.raises(StorageError, match=r"cache_offline=True reads the data from the node's data cache: give "
                                           "cache_limit too"):
        MMIDXDataset(uri, cache_dir=folder, cache_offline=True)
    with pytest.raises(StorageError, match=r"not in this node's cache .*: cannot be opened offline"):
        MMIDXDataset("s3://mmidx/cached/never-opened", cache_dir=folder, cache_limit="1G", cache_offline=True)
