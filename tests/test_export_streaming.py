"""mmidx export streams: row groups written as they fill, the same bytes at any worker count and engine, a sharded
dataset exported as its merge is, bounded memory whatever the size, and a corrupt dataset refused in one line."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.cases import CASES, FILES
from support.sources import (
    build,
    image_bytes,
    loaded_tokenizer,
    tokenizer_dir,
    write_jsonl,
    write_parquet,
    write_t2i_parquet,
)

from mmidx import format as fmt
from mmidx.cli import main
from mmidx.ingest import BuildOptions, build_dataset
from mmidx.ingest.merge import merge_datasets
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources import SourceOptions
from mmidx.toolkit import export_plan
from mmidx.toolkit.export import export
from mmidx.toolkit.export_hf import export_hf
from mmidx.toolkit.export_workers import WorkerDied, Workers, ordered_results
from mmidx.toolkit.scale_data import write_synthetic

REPO = Path(__file__).resolve().parent.parent


def folder_bytes(folder):
    """Every file under ``folder`` by its relative path, with its bytes."""
    folder = Path(folder)
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def export_any(prefix, layout, output, **run):
    return export_hf(prefix, output, **run) if layout == "hf" else export(prefix, layout, output, **run)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """The same 3,001 synthetic t2i samples as one set of files and as 7 shards."""
    folder = tmp_path_factory.mktemp("synthetic")
    tokenizer = loaded_tokenizer()
    return (write_synthetic(folder / "one", 3001, tokenizer=tokenizer),
            write_synthetic(folder / "many", 3001, shards=7, tokenizer=tokenizer))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Small real datasets of every exportable source: (prefix, layout) by name."""
    folder = tmp_path_factory.mktemp("built")
    images = [image_bytes(24, 16 + i % 5, seed=i) for i in range(40)]
    t2i_inputs = [write_t2i_parquet(folder / f"part{k}.parquet", images[k::2], [{"0": f"photo {i}", "1": f"a {k}"}
                                                                                for i in range(20)], 7)
                  for k in range(2)]
    t2i, _ = build("t2i", t2i_inputs, folder / "t2i", views=2)
    for name, data in FILES.items():
        (folder / name).write_bytes(data)
    vlm, _ = build("vlm", [write_jsonl(folder / "sft.jsonl", [row for row, _ in CASES] * 3)], folder / "vlm",
                   image_root=str(folder))
    steps = [[["make it red"]], [["add a hat"], ["crop it"]], [["zoom in"]]] * 4
    edit_images = [[image_bytes(16, 16, seed=10 * row + k) for k in range(len(s) + 1)] for row, s in enumerate(steps)]
    path = write_parquet(folder / "edit.parquet", {"image_list": edit_images, "instruction_list": steps},
                         {"image_list": pa.list_(pa.binary()), "instruction_list": pa.list_(pa.list_(pa.string()))},
                         row_group_size=4)
    edit, _ = build("edit", [path], folder / "edit", views=3)
    return {"t2i parquet": (t2i.prefix, "parquet"), "t2i wds": (t2i.prefix, "wds"), "t2i hf": (t2i.prefix, "hf"),
            "vlm jsonl": (vlm.prefix, "jsonl"), "vlm hf": (vlm.prefix, "hf"), "edit parquet": (edit.prefix, "parquet")}


@pytest.mark.parametrize("case", ["t2i parquet", "t2i wds", "t2i hf", "vlm jsonl", "vlm hf", "edit parquet"])
def test_every_layout_writes_the_same_bytes_and_report_with_one_or_two_workers(built, case, tmp_path, monkeypatch):
    monkeypatch.setattr(export_plan, "ROWS", 5)  # several row groups per file
    prefix, layout = built[case]
    one = export_any(prefix, layout, tmp_path / "one")
    two = export_any(prefix, layout, tmp_path / "two", workers=2)
    assert one.samples > 10 and len(folder_bytes(tmp_path / "one")) >= 2
    info = tmp_path / "two" / "parquet_info.json"  # edit's names the files by their paths
    if info.exists():
        info.write_text(info.read_text().replace(str((tmp_path / "two").resolve()), str((tmp_path / "one").resolve())))
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "two")
    assert (one.samples, one.images, one.lossy) == (two.samples, two.images, two.lossy)
    assert [Path(path).name for path in one.files] == [Path(path).name for path in two.files]


def test_a_ray_export_writes_the_bytes_of_a_local_one(cluster, built, synthetic, tmp_path, monkeypatch):
    monkeypatch.setattr(export_plan, "ROWS", 7)
    for number, (prefix, layout) in enumerate([built["vlm jsonl"], (synthetic[1], "wds")]):
        local = export_any(prefix, layout, tmp_path / f"local{number}")
        ray = export_any(prefix, layout, tmp_path / f"ray{number}", workers=2, engine="ray")
        assert folder_bytes(tmp_path / f"local{number}") == folder_bytes(tmp_path / f"ray{number}")
        assert (local.samples, local.lossy) == (ray.samples, ray.lossy)


@pytest.mark.parametrize("layout", ["parquet", "wds", "hf"])
def test_a_sharded_dataset_exports_the_files_and_report_of_the_same_samples_in_one_set_of_files(synthetic, layout,
                                                                                                tmp_path):
    single, sharded = synthetic
    one = export_any(single, layout, tmp_path / "one")
    many = export_any(sharded, layout, tmp_path / "many", workers=2)
    assert folder_bytes(tmp_path / "one") == folder_bytes(tmp_path / "many")
    # every sample counted once: a shard's local sample numbers are not the dataset's
    assert one.samples == many.samples == 3001 and one.lossy == many.lossy
    assert one.lossy["the file name changes, so each view's caption is drawn anew"] == 3001


def test_a_build_that_ended_sharded_exports_as_its_merge(tmp_path):
    images = [image_bytes(20, 20, seed=i) for i in range(30)]
    inputs = [write_t2i_parquet(tmp_path / f"in{k}.parquet", images[k::3], [{"0": f"cat {i}"} for i in range(10)], 3)
              for k in range(3)]
    options = BuildOptions("t2i", tuple(inputs), tokenizer_dir(), str(tmp_path / "sharded"),
                           SourceOptions(views=2, rows_per_shard=4), progress=False, layout="sharded")
    build_dataset(options)
    assert MMIDXDataset(tmp_path / "sharded").is_sharded
    merge_datasets([str(tmp_path / "sharded")], str(tmp_path / "merged"))
    for layout in ("parquet", "wds"):
        a = export(tmp_path / "sharded", layout, tmp_path / f"a-{layout}")
        b = export(tmp_path / "merged", layout, tmp_path / f"b-{layout}")
        assert folder_bytes(tmp_path / f"a-{layout}") == folder_bytes(tmp_path / f"b-{layout}")
        assert (a.samples, a.lossy) == (b.samples, b.lossy) and a.samples == 30
    assert sorted(folder_bytes(tmp_path / "a-parquet")) == ["in0.parquet", "in1.parquet", "in2.parquet"]
    assert export(tmp_path / "sharded", "parquet", tmp_path / "c").lossy == {}  # names and rows kept: round trip


def expected_groups(sizes, rows, limit):
    """Row group lengths by the rule, counted sample by sample: at most ``rows``, ending once ``limit`` bytes."""
    groups, count, size = [], 0, 0
    for sample_size in sizes:
        count, size = count + 1, size + sample_size
        if count == rows or size >= limit:
            groups.append(count)
            count, size = 0, 0
    return groups + ([count] if count else [])


def test_row_groups_end_at_the_row_or_byte_limit_within_each_file_across_files_that_interleave(tmp_path, monkeypatch):
    """Files a, b, a (two builds of an a.parquet merged around a b.parquet): a's samples from both, in order."""
    monkeypatch.setattr(export_plan, "ROWS", 6)
    prefixes = []
    for number, name in enumerate(["a", "b", "a"]):
        images = [image_bytes(8 + (i * 7 + number) % 40, 8, "RGB", "PNG", seed=100 * number + i) for i in range(17)]
        (tmp_path / str(number)).mkdir()
        path = write_t2i_parquet(tmp_path / str(number) / f"{name}.parquet", images,
                                 [{"0": f"{name} {number} {i} " + "word " * (i % 9)} for i in range(17)], 5)
        prefixes.append(str(build("t2i", [path], tmp_path / f"ds{number}")[0].prefix))
    merge_datasets(prefixes, str(tmp_path / "merged"))
    dataset = MMIDXDataset(tmp_path / "merged")
    numbers = {name: [i for i in range(len(dataset)) if os.path.basename(dataset[i].origin[0]) == f"{name}.parquet"]
               for name in ("a", "b")}
    sizes = {name: [len(dataset[i].image(0).data) + export_plan.TEXT_BYTES * sum(map(len, dataset[i].texts))
                    for i in found] for name, found in numbers.items()}
    limit = sorted(sizes["a"])[len(sizes["a"]) // 2] * 5  # about five samples a group
    monkeypatch.setattr(export_plan, "BYTES", limit)
    export(tmp_path / "merged", "parquet", tmp_path / "out", workers=2)
    for name, found in numbers.items():
        metadata = pq.ParquetFile(tmp_path / "out" / f"{name}.parquet").metadata
        groups = [metadata.row_group(k).num_rows for k in range(metadata.num_row_groups)]
        assert groups == expected_groups(sizes[name], 6, limit) and len(groups) > 3
        assert 6 in groups and min(groups) < 6  # both limits end some group
        table = pq.read_table(tmp_path / "out" / f"{name}.parquet")
        assert table.column("image").to_pylist() == [bytes(dataset[i].image(0).data) for i in found]
        assert [json.loads(c)["0"] for c in table.column("captions").to_pylist()] == \
            [loaded_tokenizer().decode(dataset[i].text(0)) for i in found]


def _export_memory(prefix, output):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import measure

    result = measure([sys.executable, "-m", "mmidx.cli", "export", str(prefix), "--to", "parquet", "-o", str(output),
                      "--quiet"], env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert result.returncode == 0, result.output
    return result.peak_anon


def test_memory_does_not_grow_with_the_number_of_samples(tmp_path):
    """The process tree's peak anonymous memory at 4,000 and at 40,000 samples: an export that held a file's rows
    (the old one: ~700 B a sample, ~25 MiB more here) grows; one that streams row groups does not."""
    tokenizer = loaded_tokenizer()
    small = _export_memory(write_synthetic(tmp_path / "small", 4_000, tokenizer=tokenizer), tmp_path / "a")
    large = _export_memory(write_synthetic(tmp_path / "large", 40_000, tokenizer=tokenizer), tmp_path / "b")
    assert large - small < 12 << 20, (small >> 20, large >> 20)


def test_a_corrupt_plan_is_one_line_naming_the_file_and_leaves_no_folder(synthetic, tmp_path, capsys):
    target = tmp_path / "bad"
    for path in Path(synthetic[0]).parent.glob("one.*"):
        (tmp_path / path.name.replace("one", "bad")).write_bytes(path.read_bytes())
    plan = fmt.file_path(target, "plan")
    data = bytearray(plan.read_bytes())
    offsets = fmt.read_plan(plan, data)["sample_image_offsets"]
    offset = offsets.ctypes.data - np.frombuffer(data, np.uint8).ctypes.data
    del offsets
    data[offset + 8 * 1500: offset + 8 * 1501] = (10 ** 9).to_bytes(8, "little")
    plan.write_bytes(bytes(data))
    for workers in ("1", "2"):
        assert main(["export", str(target), "--to", "parquet", "-o", str(tmp_path / "out"), "--workers", workers,
                     "--quiet"]) == 1
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "bad.plan" in err and "corrupted" in err, err
        assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_the_progress_bar_counts_samples_on_stderr(synthetic, tmp_path):
    process = subprocess.run([sys.executable, "-c", "import sys; import mmidx.toolkit.export as e; "
                              "e.PROGRESS_DELAY = 0; from mmidx.cli import main; sys.exit(main(sys.argv[1:]))",
                              "export", str(synthetic[1]), "--to", "wds", "-o", str(tmp_path / "out"), "--workers",
                              "2"], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                             timeout=120)
    assert process.returncode == 0, process.stderr
    assert "3.00k/3.00k" in process.stderr and "samples" in process.stderr
    assert process.stdout.startswith(f"{tmp_path / 'out'}: 3,001 samples as wds")


class _Squares:
    """A job for the workers alone: each task's square, slower for some tasks; ``die_at``: that task ends its
    worker process."""

    def __init__(self, die_at=None):
        self.die_at = die_at

    def open(self):
        return os.getpid()

    def run(self, parent, task):
        if task == self.die_at:
            os._exit(1)
        time.sleep(0.02 if task % 3 == 0 else 0)
        return task * task, parent


def test_results_come_in_task_order_from_every_worker_and_a_dead_worker_is_one_clear_error():
    results = list(ordered_results(_Squares(), iter(range(40)), Workers(workers=2)))
    assert [(task, result[0]) for task, result in results] == [(task, task * task) for task in range(40)]
    assert len({pid for _, (_, pid) in results}) == 2 and os.getpid() not in {pid for _, (_, pid) in results}
    with pytest.raises(WorkerDied, match="a worker process died"):
        list(ordered_results(_Squares(die_at=17), iter(range(40)), Workers(workers=2)))
    with pytest.raises(ValueError, match="unknown engine 'spark'"):
        Workers(engine="spark")
