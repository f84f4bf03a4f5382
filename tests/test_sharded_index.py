"""The index and read path over sharded datasets: everything that reads whole index arrays reads them a part (shard)
at a time and a chunk of samples at a time, and gives what it gives on the dataset's merge: the same pack index
bytes, packs' costs, batches, GPT indices and samples, precached encodings read from each shard's own streams; and
the pack index's build holds no per-element temporary of the whole dataset."""

import json
import os
import tracemalloc

import numpy as np
import pytest
import torch
from support.helpers import png_bytes

import mmidx.index.pack_costs
import mmidx.index.sizes
import mmidx.index.subsets
import mmidx.read.invariants
from mmidx import format as fmt
from mmidx.cli import main
from mmidx.config import DataConfig, config_for
from mmidx.encodings.encode import Job
from mmidx.encodings.precache import precache_dataset
from mmidx.images.transform import ImageTransform
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import build_pack_index
from mmidx.index.sizes import view_table
from mmidx.index.subsets import used_samples
from mmidx.ingest.merge import merge_datasets
from mmidx.ingest.sharded import write_sharded
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.prefetch import sample_ranges
from mmidx.sources.elements import Element, StoredImage
from mmidx.toolkit.scale_data import write_synthetic
from mmidx.train.gpt import GPTTextDataset
from mmidx.train.loader import PackDataset, PackLoader

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}
VAE = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
VIT = {"image_stride": 14, "max_image_size": 56, "min_image_size": 28}
PACKING = {"max_num_tokens": 400, "expected_num_tokens": 300, "max_num_tokens_per_sample": 300}
SHARDS = (5, 1, 7, 4, 6)  # samples per shard
SIZES = ((16, 16), (40, 24), (24, 56), (64, 64), (30, 30))


def _shard_samples(rng, shard: int, count: int, first_row: int):
    """(texts, images, views, origin row) of the samples of one shard: one or two views, images of several sizes."""
    for row in range(first_row, first_row + count):
        texts = [rng.integers(5, 1000, rng.integers(1, 9)).tolist() for _ in range(rng.integers(1, 3))]
        sizes = [SIZES[int(n)] for n in rng.integers(0, len(SIZES), rng.integers(1, 3))]
        images = [StoredImage(png_bytes(w, h, (shard * 40, row % 250, 9)), w, h, "PNG", "RGB") for w, h in sizes]
        views = [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]]
        if row % 3 == 1:  # some samples have a second view: an edit of the last image
            views.append([Element("vae_image", 0, enable_cfg=True), Element("vit_image", 0, enable_cfg=True),
                          Element("text", len(texts) - 1, loss=True),
                          Element("vae_image", len(images) - 1, loss=True, img_num=2)])
        yield texts, images, views, row


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A sharded t2i-like dataset of multi-view samples (sources listed by several shards, as a file split into
    units is) and its merge; a sharded text dataset and its merge."""
    folder = tmp_path_factory.mktemp("sharded")
    sharded, rng, row = folder / "ds", np.random.default_rng(7), 0
    for shard, count in enumerate(SHARDS):
        with DatasetBuilder(fmt.shard_prefix(sharded, shard), vocab_size=1000, special_tokens=SPECIAL,
                            build_config={"source": "t2i"}) as builder:
            source = builder.source_id(f"part-{shard % 3}.parquet")
            for texts, images, views, origin in _shard_samples(rng, shard, count, row):
                builder.add_sample(texts, images, views, (source, origin))
            builder.finalize()
        row += count
    write_sharded(os.fspath(sharded), list(range(len(SHARDS))), {"source": "t2i"})
    merged = merge_datasets([sharded], folder / "merged")
    text = folder / "text"
    for shard, count in enumerate((9, 3, 12)):
        with DatasetBuilder(fmt.shard_prefix(text, shard), kind="text", vocab_size=1000,
                            special_tokens={"eod": 0}) as builder:
            for _ in range(count):
                builder.add_document([np.append(rng.integers(1, 1000, rng.integers(1, 40)), 0)])
            builder.finalize()
    write_sharded(os.fspath(text), [0, 1, 2], {"source": "text"})
    return {"sharded": os.fspath(sharded), "merged": os.fspath(merged), "text": os.fspath(text),
            "merged_text": os.fspath(merge_datasets([text], folder / "merged_text"))}


def config_of(prefix, policy="bagel", **group):
    return DataConfig.from_dict({
        "groups": {"t2i": {"datasets": [prefix], "image_transform_args": VAE, "vit_image_transform_args": VIT,
                           **group}},
        "packing": {**PACKING, "policy": policy}, "dropout": {"text": 0.3, "vit": 0.3, "vae": 0.3}, "seed": 5})


def index_bytes(index):
    return {name: np.asarray(array).tobytes() for name, array in index.arrays.items()}, \
        {key: value for key, value in index.stats.items() if key != "build_seconds"}


@pytest.mark.parametrize("policy", ["bagel", "tight"])
@pytest.mark.parametrize("chunk", [3, 1 << 16])  # chunks inside and across shards, and a shard at a time
@pytest.mark.parametrize("used", [None, [4]])  # every sample, or BAGEL's num_used_data (files listed in shards)
def test_a_sharded_datasets_pack_index_is_its_merges_byte_for_byte(mixed, monkeypatch, policy, chunk, used):
    monkeypatch.setattr(mmidx.index.sizes, "CHUNK_SAMPLES", chunk)
    monkeypatch.setattr(mmidx.index.subsets, "_SAMPLES", max(2, chunk // 4))
    knobs = {} if used is None else {"num_used_data": used}
    sharded, merged = (config_of(mixed[name], policy, **knobs) for name in ("sharded", "merged"))
    tables = [view_table(config, [[MMIDXDataset(config.groups[0].datasets[0])]],
                         [[used_samples(MMIDXDataset(config.groups[0].datasets[0]), config.groups[0], 0)]])
              for config in (sharded, merged)]
    assert tables[0].max_views == tables[1].max_views == 2 and tables[0].view_tokens.dtype == np.int32
    np.testing.assert_array_equal(tables[0].view_tokens, tables[1].view_tokens)
    np.testing.assert_array_equal(tables[0].view_offsets, tables[1].view_offsets)
    indices = [build_pack_index(config, num_samples=150, progress=False) for config in (sharded, merged)]
    assert index_bytes(indices[0]) == index_bytes(indices[1]) and len(indices[0]) > 5
    whole = PackCosts(indices[1])[:]  # priced after dropout, a range of packs at a time
    monkeypatch.setattr(mmidx.index.pack_costs, "CHUNK_ITEMS", chunk)
    np.testing.assert_array_equal(PackCosts(indices[0])[:], whole)
    if used is not None:  # the files' samples BAGEL's cycled list takes, numbered across the shards
        np.testing.assert_array_equal(indices[0].selections[0][0], indices[1].selections[0][0])
        assert len(indices[0].selections[0][0]) < sum(SHARDS)


def test_mmidx_index_reports_the_same_on_a_sharded_dataset_and_its_merge(mixed, tmp_path, capsys):
    reports = []
    for name in ("sharded", "merged"):
        path = tmp_path / f"{name}.yaml"
        path.write_text(json.dumps({"groups": {"t2i": {"datasets": [mixed[name]], "image_transform_args": VAE,
                                                       "vit_image_transform_args": VIT}}, "packing": PACKING}))
        assert main(["index", str(path), "--json", "--world-size", "2", "--global-batch-size", "4"]) == 0
        report = json.loads(capsys.readouterr().out)
        report.pop("build_seconds")
        reports.append(report)
    assert reports[0] == reports[1] and set(reports[0]["gpu_time"]) == {"bagel", "tight"}


def everything(batch):
    """Every key of a batch, comparable with ==; the dataset each sample was read from (a shard) aside."""
    data = batch.to_dict()
    found = {key: value.tolist() if isinstance(value, torch.Tensor) else value for key, value in data.items()
             if key not in ("batch_data_indexes", "attention_mask")}
    found["batch_data_indexes"] = [{k: v for k, v in d.items() if k != "dataset"} for d in data["batch_data_indexes"]]
    return found


def test_the_loader_gives_a_sharded_dataset_the_batches_of_its_merge(mixed):
    batches = []
    for name in ("sharded", "merged"):
        config = config_of(mixed[name], "tight")
        packs = PackDataset(build_pack_index(config, num_samples=200, progress=False),
                            PackBuilder(config, special_tokens=SPECIAL))
        index = packs.packs
        batches.append([everything(batch) for batch in PackLoader(packs, global_batch_size=2,
                                                                  pack_costs=PackCosts(index))])
    assert len(batches[0]) >= 4 and batches[0] == batches[1]


def test_gpt_indices_and_samples_of_a_sharded_text_dataset_are_its_merges(mixed, tmp_path, capsys):
    sharded, merged = (GPTTextDataset(mixed[name], seq_length=16, num_samples=40, seed=3, cache_dir=tmp_path)
                       for name in ("text", "merged_text"))
    for name in ("document_index", "sample_index", "shuffle_index"):
        np.testing.assert_array_equal(getattr(sharded, name), getattr(merged, name))
    assert len(sharded) >= 40 and sharded.sequences.count == merged.sequences.count == 24
    spans = 0
    for i in range(len(sharded)):
        mine, theirs = sharded[i], merged[i]
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        spans = max(spans, len(np.unique(np.searchsorted([9, 12], sharded.spans(i)[0], side="right"))))
    assert spans >= 2  # some samples span shards
    lines = []
    for name in ("text", "merged_text"):
        assert main(["index", "--gpt", mixed[name], "--seq-length", "16", "--num-samples", "500"]) == 0
        lines.append(capsys.readouterr().out)
    assert lines[0].replace(mixed["text"], "P") == lines[1].replace(mixed["merged_text"], "P")
    assert "epochs of the documents" in lines[0]


def test_precache_of_a_sharded_dataset_writes_each_shards_streams_and_packs_read_them(mixed, tmp_path):
    job = Job("lat", "support.encoders:vae", dtype="fp32", batch_size=1)  # (batches differ: the shards' hold less)
    transform = ImageTransform(**VAE)
    summary = precache_dataset(mixed["sharded"], job, transform, progress=False)
    whole = precache_dataset(mixed["merged"], job, transform, progress=False)
    dataset = MMIDXDataset(mixed["sharded"])
    assert summary["shards"] == len(SHARDS) and summary["counts"] == whole["counts"]
    assert summary["dataset"] == {"checksum": dataset.checksum, "samples": len(dataset)}
    for part in dataset.parts:  # each shard's stream beside it, of the shard
        meta = json.loads(fmt.encoding_path(part.dataset.prefix, "lat", "json").read_text())
        assert meta["dataset"]["checksum"] == part.dataset.checksum
    assert not fmt.encoding_path(mixed["sharded"], "lat", "json").exists()
    batches = []
    for name in ("sharded", "merged"):
        config = config_of(mixed[name])
        builder = PackBuilder(config, special_tokens=SPECIAL, encodings={"vae": "lat"})
        index = build_pack_index(config, num_samples=30, progress=False)
        batches.append([everything(builder.build(k, index.items(k))) for k in range(len(index))])
    assert batches[0] == batches[1] and "padded_latent" in batches[0][0]


def test_a_sharded_dataset_in_object_storage_reads_the_batches_of_its_local_copy_fetched_ahead(mixed, s3):
    dataset = MMIDXDataset(mixed["sharded"])
    uri = s3.upload(mixed["sharded"], "s3://mmidx/sharded/ds")
    for part in dataset.parts:
        s3.upload(part.dataset.prefix, uri + part.dataset.prefix[len(mixed["sharded"]):])
    remote = MMIDXDataset(uri)
    assert remote.is_sharded and len(remote) == len(dataset) and remote.parts[3].dataset.remote_files
    samples = np.array([20, 0, 5, 6, 13, 5, 22])
    for file, (starts, stops, owners) in sample_ranges(remote, samples).items():  # grouped by shard
        assert file.uri.startswith(f"{uri}.shards/") and set(owners.tolist()) <= set(range(len(samples)))
        assert np.all(stops > starts)
    owners = sorted(owner for ranges in sample_ranges(remote, samples).values() for owner in ranges[2].tolist())
    assert owners == sorted(list(range(len(samples))) * 2)  # each sample's tokens and images
    batches = []
    for prefix in (mixed["sharded"], uri):
        config = config_of(prefix)
        packs = PackDataset(build_pack_index(config, num_samples=40, progress=False),
                            PackBuilder(config, special_tokens=SPECIAL))
        batches.append([everything(batch) for batch in PackLoader(packs, global_batch_size=2)])
    files = [file for part in packs.builder.datasets[0][0].parts for file in part.dataset.remote_files.values()]
    assert batches[0] == batches[1] and sum(file.misses for file in files) == 0  # every read fetched ahead
    assert sum(file.requests for file in files) > 0


def test_a_retry_finds_the_rows_an_earlier_sharded_build_stored_in_each_shard_listing_the_file(mixed):
    from mmidx.sources import WorkUnit
    from mmidx.sources.urls import _Earlier

    dataset = MMIDXDataset(mixed["sharded"])
    for path, first_row, rows in (("part-0.parquet", 0, None), ("part-1.parquet", 5, 4), ("part-2.parquet", 0, 100)):
        earlier = _Earlier(mixed["sharded"], WorkUnit(path, first_row=first_row, rows=rows))
        expected = {dataset[i].origin[1]: i for i in range(len(dataset)) if dataset[i].origin[0] == path
                    and first_row <= dataset[i].origin[1] < (first_row + rows if rows is not None else 10**9)}
        assert earlier.samples == expected and expected
        _, sample = next(iter(expected.items()))
        assert bytes(dataset[sample].image(0).data) == bytes(MMIDXDataset(mixed["merged"])[sample].image(0).data)
        assert _Earlier(mixed["merged"], WorkUnit(path, first_row=first_row, rows=rows)).samples == expected
    whole = WorkUnit("part-0.parquet", first_row=0, rows=None)  # the file of shards 0 and 3 (listed twice merged)
    assert len(_Earlier(mixed["sharded"], whole).samples) == SHARDS[0] + SHARDS[3]


def test_ray_data_rows_of_a_sharded_dataset_number_its_samples_as_its_merge_does(mixed):
    pytest.importorskip("ray")
    from mmidx.toolkit.ray_data.datasource import MMIDXDatasource, _read_range

    columns = ("sample", "tokens", "image_sizes", "origin_file", "origin_row")
    rows = [[row for table in _read_range(mixed[name], 3, 22, columns, None) for row in table.to_pylist()]
            for name in ("sharded", "merged")]
    assert rows[0] == rows[1] and [row["sample"] for row in rows[0]] == list(range(3, 22))
    sizes = [MMIDXDatasource([mixed[name]], columns).estimate_inmemory_data_size() for name in ("sharded", "merged")]
    assert sizes[0] == sizes[1] > fmt.file_path(mixed["merged"], "images").stat().st_size


def test_a_single_view_sharded_set_keeps_no_view_offsets_and_indexes_as_one_set_of_files(tmp_path, monkeypatch):
    monkeypatch.setattr(mmidx.index.sizes, "CHUNK_SAMPLES", 1000)
    single, shards = write_synthetic(tmp_path / "one", 5000), write_synthetic(tmp_path / "many", 5000, shards=7)
    tables = [view_table(config_for([os.fspath(p)]), [[MMIDXDataset(p)]]) for p in (single, shards)]
    assert tables[0].offsets is None and tables[0].max_views == 1 and tables[0].view_tokens.nbytes == 4 * 5000
    np.testing.assert_array_equal(tables[0].view_tokens, tables[1].view_tokens)
    indices = [build_pack_index(config_for([os.fspath(p)]), progress=False, chunk_size=777) for p in (single, shards)]
    assert index_bytes(indices[0]) == index_bytes(indices[1]) and "views" not in indices[0].arrays


def _peak(function):
    """The most bytes ``function()`` had allocated at once beyond what it started with (numpy's arrays are traced),
    and its result."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = function()
        return tracemalloc.get_traced_memory()[1] - base, result
    finally:
        tracemalloc.stop()


def test_sizing_and_packing_hold_a_few_bytes_a_sample_whatever_the_chunk_holds(tmp_path, monkeypatch):
    """The old sizing made ~730 bytes of temporaries a sample (every element's sample number twice, its counts,
    image sizes...); now the view table (4 bytes a sample here) and the packs (a few bytes an item) are all that
    grows, the rest is bounded by the chunks (here 4,096 samples and 16,384 stream items)."""
    samples = 200_000
    monkeypatch.setattr(mmidx.index.sizes, "CHUNK_SAMPLES", 4096)
    monkeypatch.setattr(mmidx.read.invariants, "_CHUNK", 4096)
    monkeypatch.setattr(mmidx.index.pack_costs, "CHUNK_ITEMS", 4096)
    for prefix in (write_synthetic(tmp_path / "one", samples), write_synthetic(tmp_path / "many", samples, shards=5)):
        config = config_for([os.fspath(prefix)])
        dataset = MMIDXDataset(prefix)
        checked, _ = _peak(dataset.check_structure)
        sized, table = _peak(lambda: view_table(config, [[dataset]]))  # noqa: B023 (called at once)
        assert table.view_tokens.nbytes == 4 * samples and checked < 2 << 20
        assert sized - table.view_tokens.nbytes < 6 << 20, sized
        built, index = _peak(lambda: build_pack_index(config, progress=False, chunk_size=1 << 14))  # noqa: B023
        outputs = sum(np.asarray(array).nbytes for array in index.arrays.values())
        assert built - outputs < 4 * samples + (10 << 20), (built, outputs)
        priced, costs = _peak(lambda: PackCosts(index)[:])  # noqa: B023
        assert priced - costs.nbytes < 4 << 20, priced
