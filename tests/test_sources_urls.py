"""URL tables → datasets: every row ends in one class, bytes as served, files independent of concurrency,
resumable after kill -9, transient failures retried (and refetched by --retry-failed), permanent ones never."""

import gzip
import hashlib
import json
import os
import time
from collections import Counter

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
from support.build_cases import kill_after_first_shard
from support.http_faults import HUGE_BYTES, FaultServer
from support.sources import build, image_bytes, tokenizer_dir, write_t2i_parquet

from mmidx.cli import main
from mmidx.fetch.ledger import ledger_path
from mmidx.format import FormatError, file_path
from mmidx.ingest import BuildOptions, build_dataset
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources import SKIP_REASONS, SourceOptions

FAST = {"fetch_timeout": 1.0, "fetch_retries": 1, "max_image_bytes": 1 << 20}
FAST_CLI = ["--timeout", "1", "--fetch-retries", "1", "--max-image-bytes", str(1 << 20)]
DATA_FILES = ("bin", "idx", "images", "plan", "meta")

# (path on the fault server, the row's class): every failure the issue lists, and successes
CASES = [
    ("/image/jpeg", "ok"), ("/image/png", "ok"), ("/image/webp", "ok"),
    ("/status/404", "not_found"), ("/status/410", "not_found"), ("/status/403", "http_error"),
    ("/status/500", "http_error"), ("/flaky/1/jpeg", "ok"), ("/ratelimit/1/png", "ok"),
    ("/drip", "timeout"), ("/reset", "connection"), ("/short/jpeg", "connection"),
    ("/html", "not_an_image"), ("/huge", "too_large"), ("/bomb", "too_large"),
    ("/redirect/3/webp", "ok"), ("/redirect/7/jpeg", "redirects"), ("/loop", "redirects"),
    ("/tofile", "redirects"), ("/noai/jpeg", "opted_out"), ("/otherbot/png", "ok"),
    ("ftp://127.0.0.1/x.jpg", "invalid_url"),
]


@pytest.fixture(scope="module")
def server():
    server = FaultServer(latency=(0.0, 0.02), seed=1)
    for name, fmt in (("jpeg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")):
        server.add_image(name, image_bytes(40, 30, "RGB", fmt, seed=len(name)))
    for i in range(30):
        server.add_image(f"i{i}", image_bytes(24 + i, 20, "RGB", "JPEG" if i % 2 else "PNG", seed=100 + i))
    yield server
    server.stop()


def _url(server, path):
    return path if "://" in path else server.url(path)


def _caption(row):
    return json.dumps({"0": f"a cat {row}", "1": f"red sky {row}"}) if row % 2 else f"photo of a dog {row}"


def write_table(path, urls, captions=None, extra=None):
    columns = {"URL": urls, "TEXT": captions if captions is not None else [_caption(i) for i in range(len(urls))]}
    pq.write_table(pa.table({**columns, **(extra or {})}), path, row_group_size=5)
    return str(path)


def served(server, path):
    """The bytes the server sends for ``path`` when it succeeds (None for routes that never do)."""
    name = path.split("?")[0].rstrip("/").rsplit("/", 1)[-1]
    return server.images.get(name)


def ledger_of(prefix):
    return pq.read_table(ledger_path(prefix)).to_pylist()


@pytest.fixture(scope="module")
def faults(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("faults")
    rows = [*CASES, ("/image/jpeg?caption=none", "bad_captions")]
    captions = [_caption(i) for i in range(len(CASES))] + [None]
    table = write_table(folder / "faults.parquet", [_url(server, path) for path, _ in rows], captions)
    tokenizer_dir()  # trained once per session: not part of the time taken
    started = time.monotonic()
    dataset, report = build("urls", [table], folder / "out", url_column="URL", caption_columns=("TEXT",),
                            user_agent_token="mmidx-tests", **FAST)
    return {"dataset": dataset, "report": report.data, "rows": rows, "table": table, "folder": folder,
            "seconds": time.monotonic() - started}


def test_every_row_ends_in_exactly_one_class(faults):
    report, rows = faults["report"], faults["rows"]
    assert [entry["class"] for entry in ledger_of(faults["folder"] / "out")] == [cls for _, cls in rows]
    assert [entry["row"] for entry in ledger_of(faults["folder"] / "out")] == list(range(len(rows)))
    assert report["rows"] == len(rows) == report["samples"] + report["skipped"]
    expected = Counter(cls if cls == "bad_captions" else f"fetch:{cls}" for _, cls in rows if cls != "ok")
    assert {reason: entry["count"] for reason, entry in report["skips"].items()} == expected
    assert all(report["reasons"][reason] == SKIP_REASONS[reason] for reason in expected)


def test_stored_bytes_are_the_bytes_served_and_the_ledger_has_their_sha256(faults, server):
    dataset, rows, ledger = faults["dataset"], faults["rows"], ledger_of(faults["folder"] / "out")
    stored = {dataset[i].origin[1]: bytes(dataset[i].image(0).data) for i in range(len(dataset))}
    assert sorted(stored) == [row for row, (_, cls) in enumerate(rows) if cls == "ok"]
    for row, data in stored.items():
        assert data == served(server, rows[row][0])
        assert ledger[row]["sha256"] == hashlib.sha256(data).hexdigest() and ledger[row]["bytes"] == len(data)


def test_permanent_failures_are_requested_once_and_transient_ones_retried(faults, server):
    requests = server.requests
    for path in ("/status/404", "/status/410", "/status/403", "/html", "/huge", "/bomb", "/loop", "/tofile",
                 "/noai/jpeg"):
        assert requests[path] == 1, path
    for path in ("/status/500", "/drip", "/short/jpeg", "/flaky/1/jpeg", "/ratelimit/1/png"):
        assert requests[path] == 2, path  # the first try and one retry (fetch_retries=1)
    assert requests["/reset"] == 2  # no hidden re-send by aiohttp on the reset connection
    attempts = {faults["rows"][entry["row"]][0]: entry["attempts"] for entry in ledger_of(faults["folder"] / "out")}
    assert attempts["/status/404"] == 1 and attempts["/status/500"] == 2 and attempts["/flaky/1/jpeg"] == 2


def test_the_requests_the_server_saw_are_the_tries_the_ledger_records_for_every_row_and_fault_class(server,
                                                                                                     tmp_path):
    # aiohttp re-sends a request once, unseen, when the connection drops (/reset): each try must be one request
    paths = [f"{path}?wire={row}" for row, (path, _) in enumerate(CASES) if "://" not in path]
    table = write_table(tmp_path / "wire.parquet", [server.url(path) for path in paths])
    build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
          **{**FAST, "fetch_retries": 2, "fetch_timeout": 1.0})
    ledger = ledger_of(tmp_path / "out")
    assert [server.requests[path] for path in paths] == [entry["attempts"] for entry in ledger]
    assert ledger[paths.index(next(p for p in paths if p.startswith("/reset")))]["attempts"] == 3


def test_retry_after_is_waited_for(faults, server):
    first, second = server.times["/ratelimit/1/png"]
    assert second - first >= 0.95


def test_the_80_mib_body_is_cut_by_the_byte_cap_early(faults, server):
    assert server.huge_sent < HUGE_BYTES // 4


def test_nothing_but_decodable_images_within_the_limits_is_stored(faults):
    dataset = faults["dataset"]
    assert len(dataset) == sum(cls == "ok" for _, cls in faults["rows"])
    assert {dataset[i].image(0).format for i in range(len(dataset))} == {"JPEG", "PNG", "WEBP"}
    # the dripping body (60 s long) and the reset end at the deadline plus one retry: nothing hangs
    assert faults["seconds"] < 30


def test_each_sample_is_the_one_the_t2i_source_builds_from_the_same_bytes(faults, server, tmp_path):
    rows = faults["rows"]
    images = [served(server, path) if cls == "ok" else b"" for path, cls in rows]  # b"": a skipped row
    captions = [json.loads(c) if row % 2 else {"0": c} for row, c in enumerate(_caption(i) for i in range(len(rows)))]
    os.mkdir(tmp_path / "t2i")
    parquet = write_t2i_parquet(tmp_path / "t2i" / "faults.parquet", images, captions, row_group_size=5)
    reference, _ = build("t2i", [parquet], tmp_path / "t2i-out")
    dataset = faults["dataset"]
    assert len(dataset) == len(reference)
    for i in range(len(dataset)):
        mine, theirs = dataset[i], reference[i]
        assert mine.origin[1] == theirs.origin[1]
        assert [t.tolist() for t in mine.texts] == [t.tolist() for t in theirs.texts]
        assert bytes(mine.image(0).data) == bytes(theirs.image(0).data)
        assert [mine.sequence_plan(v) for v in range(4)] == [theirs.sequence_plan(v) for v in range(4)]


def test_the_user_agent_names_mmidx_and_the_users_token(faults, server):
    assert any(agent.startswith("mmidx/") and "mmidx-tests" in agent for agent in server.user_agents)


def test_ignore_opt_out_stores_the_image_and_counts_a_warning(server, tmp_path):
    table = write_table(tmp_path / "t.parquet", [server.url("/noai/png?ignored")])
    dataset, report = build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
                            ignore_opt_out=True, **FAST)
    assert bytes(dataset[0].image(0).data) == server.images["png"]
    assert report.data["warnings"]["fetch:opt_out_ignored"]["count"] == 1


# --------------------------------------------------------------------------- determinism and resumption


def _mixed_urls(server, tag):
    """30 images, 5 not found, 5 HTML pages, interleaved; distinct URLs per ``tag``."""
    paths = [f"/image/i{i}" for i in range(30)] + ["/status/404"] * 5 + ["/html"] * 5
    order = [(i * 7) % 40 for i in range(40)]
    return [server.url(f"{paths[j]}?{tag}={j}") for j in order]


def _same_files(a, b):
    return all(file_path(a, role).read_bytes() == file_path(b, role).read_bytes() for role in DATA_FILES) \
        and ledger_path(a).read_bytes() == ledger_path(b).read_bytes()


@pytest.fixture(scope="module")
def mixed(server, tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    table = write_table(folder / "mixed.parquet", _mixed_urls(server, "mixed"))
    os.mkdir(folder / "serial")  # every output is named "out": the metadata names the files
    build("urls", [table], folder / "serial" / "out", url_column="URL", caption_columns=("TEXT",), rows_per_shard=5,
          fetch_concurrency=1, per_host=1, **FAST)
    return table, folder / "serial" / "out"


def test_files_are_identical_at_concurrency_1_and_64_with_random_latency(mixed, tmp_path):
    table, serial = mixed
    _, report = build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
                      rows_per_shard=5, fetch_concurrency=64, per_host=64, **FAST)
    assert report.data["samples"] == 30 and report.data["skipped"] == 10
    assert _same_files(serial, tmp_path / "out")


def test_a_build_killed_mid_way_resumes_to_identical_files(mixed, tmp_path):
    table, serial = mixed
    finished = kill_after_first_shard(
        ["build", "--source", "urls", "--input", table, "--tokenizer", tokenizer_dir(), "--output",
         str(tmp_path / "out"), "--url-column", "URL", "--caption-column", "TEXT", "--rows-per-shard", "5",
         "--fetch-concurrency", "2", "--quiet", *FAST_CLI], tmp_path / "out")
    assert 1 <= finished < 8, "the kill did not land mid-way"
    with pytest.raises(FormatError):
        MMIDXDataset(tmp_path / "out")
    _, report = build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",), rows_per_shard=5,
                      fetch_concurrency=8, **FAST)
    assert report.data["reused_units"] == finished
    assert _same_files(serial, tmp_path / "out")


def test_a_build_split_over_two_nodes_merges_to_identical_files(mixed, tmp_path):
    table, serial = mixed
    for rank in range(2):
        build_dataset(BuildOptions("urls", (table,), tokenizer_dir(), str(tmp_path / "out"), SourceOptions(
            url_column="URL", caption_columns=("TEXT",), rows_per_shard=5, **FAST), num_nodes=2, node_rank=rank,
            progress=False))
    assert main(["merge", str(tmp_path / "out.shards"), "--output", str(tmp_path / "out")]) == 0
    assert _same_files(serial, tmp_path / "out")


def test_the_ray_engine_runs_the_same_units_to_identical_files(mixed, tmp_path):
    """One Ray task per unit, each with its own fetcher (a cluster started in this session is reused)."""
    table, serial = mixed
    report = build_dataset(BuildOptions("urls", (table,), tokenizer_dir(), str(tmp_path / "out"), SourceOptions(
        url_column="URL", caption_columns=("TEXT",), rows_per_shard=5, **FAST), engine="ray", workers=2, progress=False,
        max_skip_rate=1.0))
    assert report.data["units"] == 8
    assert _same_files(serial, tmp_path / "out")


def test_retry_failed_fetches_again_only_the_rows_that_failed_transiently(server, tmp_path):
    paths = ["/image/i1?retry", "/status/404?retry", "/flaky/1/i2?retry", "/html?retry", "/image/i3?retry"]
    table = write_table(tmp_path / "retry.parquet", [server.url(path) for path in paths])
    options = {"url_column": "URL", "caption_columns": ("TEXT",), **FAST, "fetch_retries": 0}
    build("urls", [table], tmp_path / "out", **options)
    assert [entry["class"] for entry in ledger_of(tmp_path / "out")] == ["ok", "not_found", "http_error",
                                                                          "not_an_image", "ok"]
    report = build_dataset(BuildOptions("urls", (table,), tokenizer_dir(), str(tmp_path / "out"), SourceOptions(
        **options, retry_failed=str(tmp_path / "out")), max_skip_rate=1.0, progress=False, force=True))
    assert [entry["class"] for entry in ledger_of(tmp_path / "out")] == ["ok", "not_found", "ok", "not_an_image",
                                                                          "ok"]
    assert [server.requests[path] for path in paths] == [1, 1, 2, 1, 1]
    dataset = MMIDXDataset(tmp_path / "out")
    assert report.data["samples"] == len(dataset) == 3
    assert [bytes(dataset[i].image(0).data) for i in range(3)] == [server.images[n] for n in ("i1", "i2", "i3")]


# --------------------------------------------------------------------------- table formats and the CLI


@pytest.mark.parametrize("name", ["urls.csv", "urls.tsv.gz", "urls.jsonl", "urls.jsonl.gz"])
def test_csv_tsv_and_jsonl_tables_give_the_samples_parquet_gives(server, tmp_path, name):
    urls = [server.url(f"/image/i{i}?format={name}") for i in range(4)] + [server.url(f"/status/404?f={name}")]
    keys = [f"k{i}" for i in range(5)]
    captions = [f"photo {i}" for i in range(5)]  # one caption per row: the views do not depend on the file name
    reference, _ = build("urls", [write_table(tmp_path / "urls.parquet", urls, captions, {"key": keys})],
                         tmp_path / "reference", url_column="URL", caption_columns=("TEXT",), keep_columns=("key",),
                         **FAST)
    path = tmp_path / name
    rows = [{"URL": u, "TEXT": c, "key": k} for u, c, k in zip(urls, captions, keys, strict=True)]
    if ".jsonl" in name:
        text = "".join(json.dumps(row) + "\n" for row in rows).encode()
    else:
        sink = pa.BufferOutputStream()
        pacsv.write_csv(pa.Table.from_pylist(rows), sink,
                        pacsv.WriteOptions(delimiter="\t" if ".tsv" in name else ","))
        text = sink.getvalue().to_pybytes()
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    dataset, report = build("urls", [path], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
                            keep_columns=("key",), rows_per_shard=2, **FAST)
    assert report.data["units"] == 3 and report.data["rows"] == 5 and len(dataset) == len(reference) == 4
    for i in range(4):
        assert dataset[i].extra == {"key": f"k{i}"} == reference[i].extra
        assert bytes(dataset[i].image(0).data) == bytes(reference[i].image(0).data)
        assert [t.tolist() for t in dataset[i].texts] == [t.tolist() for t in reference[i].texts]


def test_the_cli_prints_the_class_table_and_warns_past_20_percent_failures(server, tmp_path, capsys):
    urls = [server.url("/image/i4?cli"), server.url("/status/404?cli1"), server.url("/status/404?cli2")]
    table = write_table(tmp_path / "laion.parquet", urls)
    code = main(["build", "--source", "urls", "--input", table, "--url-column", "URL", "--caption-column", "TEXT",
                 "--tokenizer", tokenizer_dir(), "--output", str(tmp_path / "out"), "--quiet", *FAST_CLI])
    out = capsys.readouterr().out
    assert code == 0  # URL ingest expects failures: no --max-skip-rate given, no failure
    assert "2 × fetch:not_found" in out and "warning: 66.7% of the rows failed to download" in out


def test_a_table_without_the_url_column_is_one_clear_error(server, tmp_path, capsys):
    table = write_table(tmp_path / "t.parquet", [server.url("/image/i5")])
    code = main(["build", "--source", "urls", "--input", table, "--url-column", "link", "--caption-column", "TEXT",
                 "--tokenizer", tokenizer_dir(), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and "no column ['link']" in err and "Traceback" not in err


def test_prompt_condition_images_given_by_http_urls_are_fetched_with_the_same_classes(server, tmp_path):
    refs = [server.url("/image/i6?prompt"), server.url("/status/404?prompt"), server.url("/html?prompt")]
    entries = [{"prompt": f"make it red {i}", "media_refs": [{"modality": "image", "role": "condition", "uri": uri}]}
               for i, uri in enumerate(refs)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(entry) + "\n" for entry in entries))
    dataset, report = build("prompts", [tmp_path / "prompts.jsonl"], tmp_path / "out", **FAST)
    assert len(dataset) == 1 and bytes(dataset[0].image(0).data) == server.images["i6"]
    assert dataset[0].extra["media_refs"][0]["uri"] == refs[0]
    assert {reason: entry["count"] for reason, entry in report.data["skips"].items()} == {
        "fetch:not_found": 1, "fetch:not_an_image": 1}
    assert server.requests["/status/404?prompt"] == 1


def test_the_progress_bar_shows_failure_classes_and_megabytes_per_second(server, tmp_path, capsys):
    urls = [server.url("/image/i7?bar"), server.url("/status/404?bar1"), server.url("/status/404?bar2")]
    table = write_table(tmp_path / "t.parquet", urls)
    build_dataset(BuildOptions("urls", (table,), tokenizer_dir(), str(tmp_path / "out"), SourceOptions(
        url_column="URL", caption_columns=("TEXT",), **FAST), max_skip_rate=1.0, progress=True))
    err = capsys.readouterr().err
    assert "1 samples, 2 skipped, fetch:not_found 2" in err and " MB/s)" in err


def test_the_cli_retry_failed_rebuilds_the_output_from_its_ledger(server, tmp_path, capsys):
    table = write_table(tmp_path / "t.parquet", [server.url("/flaky/1/i8?cli"), server.url("/status/404?cliretry")])
    command = ["build", "--source", "urls", "--input", table, "--url-column", "URL", "--caption-column", "TEXT",
               "--tokenizer", tokenizer_dir(), "--output", str(tmp_path / "out"), "--quiet", *FAST_CLI,
               "--fetch-retries", "0"]
    assert main(command) == 1  # nothing was built: no dataset written
    assert [entry["class"] for entry in ledger_of(tmp_path / "out")] == ["http_error", "not_found"]
    assert main([*command, "--retry-failed"]) == 0
    assert [entry["class"] for entry in ledger_of(tmp_path / "out")] == ["ok", "not_found"]
    assert server.requests["/status/404?cliretry"] == 1
    assert bytes(MMIDXDataset(tmp_path / "out")[0].image(0).data) == server.images["i8"]


def test_resolve_pins_a_host_name_to_an_address_without_asking_dns(server, tmp_path):
    table = write_table(tmp_path / "t.parquet", [server.url("/image/i9?resolve", host="images.example")])
    dataset, _ = build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
                       resolve=("images.example=127.0.0.1",), **FAST)
    assert bytes(dataset[0].image(0).data) == server.images["i9"]
