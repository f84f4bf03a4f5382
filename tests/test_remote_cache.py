"""The data cache of remote datasets on moto's S3 server (127.0.0.1): with a limit above the dataset a second
epoch reads every byte from the cache with the server stopped; with a third of the dataset the batches equal the
local copy's, the folder stays within its limit while the loader's processes share it, and eviction by next use
hits at least as often as LRU on the same trace; the commands take --cache-dir and --cache-limit, and
``mmidx cache info`` and ``clear`` report and empty the cache."""

import logging
import os
import pickle
import random
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
from mmidx.io.block_cache import NEVER, BlockCache
from mmidx.io.cache_folder import CacheError, CacheSettings, create, folder_bytes, read_state
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
    cache_at(tmp_path / "cache", 4 * BLOCK, monkeypatch)
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
    with pytest.raises(CacheError, match=r"holds fewer than 4 blocks of 1,048,576: give at least"):
        MMIDXDataset(stored["remote"], cache_dir=tmp_path, cache_limit="1M")
    (tmp_path / "file").write_text("")
    assert main(["sample", stored["remote"], "0", "--cache-dir", str(tmp_path / "file"), "--cache-limit", "1G"]) == 1
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "the data cache cannot be written there" in error
