"""mmidx view over HTTP: what each page shows, what it refuses (404s, traversal, foreign hosts), its bounds
(time limit, 200 concurrent requests) and its command line (loopback by default, a warning otherwise)."""

import asyncio
import io
import json
import re
import shutil
import socket
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image
from starlette.testclient import TestClient
from support.view_data import (
    PLANTED_CAPTION,
    PLANTED_SAMPLE,
    PLANTED_WORD,
    SAMPLES,
    TEXT_ONLY_SAMPLE,
    TIFF_SAMPLE,
    TWO_VIEWS_SAMPLE,
    build_planted_dataset,
    caption,
    write_data_yaml,
)

from mmidx import format as fmt
from mmidx.cli import build_parser, main
from mmidx.encodings.encode import Job
from mmidx.encodings.precache import precache
from mmidx.read.dataset import MMIDXDataset
from mmidx.toolkit.view.app import create_app, is_loopback, serving
from mmidx.toolkit.view.catalog import Catalog
from mmidx.toolkit.view.search import search_texts
from mmidx.toolkit.view.stats import aspect_histogram, integer_histogram
from mmidx.toolkit.view.thumbs import THUMBNAIL_SIDE

NAME = "planted"


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("view")
    prefix = build_planted_dataset(folder)
    data_yaml = write_data_yaml(folder, prefix)
    catalog = Catalog([str(data_yaml)])
    return {"prefix": prefix, "yaml": data_yaml, "catalog": catalog,
            "client": TestClient(create_app(catalog, allowed_hosts=["testserver"]))}


def get(planted, url, status=200):
    response = planted["client"].get(url)
    assert response.status_code == status, (url, response.text[-500:])
    assert "Traceback" not in response.text
    return response


def test_integer_histogram_counts_each_value_in_the_bar_whose_range_holds_it():
    values = np.random.default_rng(0).integers(-50, 4000, 5000)
    histogram = integer_histogram("values", values, bars=40)
    assert len(histogram.counts) <= 40 and histogram.total == len(values)
    for label, count in zip(histogram.labels, histogram.counts, strict=True):
        low, _, high = label.replace(",", "").partition("–")
        assert count == np.count_nonzero((values >= int(low)) & (values <= int(high or low)))


def test_integer_histogram_gives_one_bar_per_value_when_the_range_is_small():
    histogram = integer_histogram("images", np.array([0, 1, 1, 1, 3]))
    assert histogram.labels == ["0", "1", "2", "3"] and histogram.counts == [1, 3, 0, 1]


def test_aspect_histogram_puts_each_ratio_in_the_eighth_octave_bar_around_it():
    rng = np.random.default_rng(1)
    widths, heights = rng.integers(1, 3000, 2000), rng.integers(1, 3000, 2000)
    histogram = aspect_histogram(widths, heights)
    expected = [0] * 35
    for width, height in zip(widths.tolist(), heights.tolist(), strict=True):
        ratio = width / height
        bar = next((k for k in range(-16, 17) if 2 ** ((k - 0.5) / 8) <= ratio < 2 ** ((k + 0.5) / 8)), None)
        expected[0 if bar is None and ratio < 1 else 34 if bar is None else bar + 17] += 1
    assert histogram.counts == expected and histogram.labels[17] == "1.00"


def test_overview_shows_counts_histograms_and_the_build_report_escaped(planted):
    page = get(planted, "/").text
    dataset = MMIDXDataset(planted["prefix"])
    assert f"<td class=\"n\">{len(dataset):,}</td>" in page
    assert f"<td class=\"n\">{int(dataset.tokens.sequence_lengths.sum()):,}</td>" in page
    overview = planted["catalog"].overview(NAME)
    images_per_sample = next(h for h in overview["histograms"] if h.title == "images per sample")
    assert dict(zip(images_per_sample.labels, images_per_sample.counts, strict=True)) == \
        {"0": 1, "1": SAMPLES - 2, "2": 1}  # the text-only sample, the two-image one, the rest
    tokens = next(h for h in overview["histograms"] if h.title == "tokens per sample")
    assert tokens.total == SAMPLES
    assert "Fetch outcomes" in page and "fetch:not_found" in page and "the server answered 404 or 410" in page
    assert "not an image: &lt;html&gt;" in page and "not an image: <html>" not in page
    assert page.count('class="chart"') == len(overview["histograms"])


def test_sample_page_shows_every_view_in_order_with_decoded_text_and_stored_image_facts(planted):
    page = get(planted, f"/dataset/{NAME}/sample/{TWO_VIEWS_SAMPLE}").text
    first, second = page.index("View 0 of 2"), page.index("View 1 of 2")
    assert first < page.index(caption(TWO_VIEWS_SAMPLE), first) < second < page.index("make it blue", second)
    dataset = MMIDXDataset(planted["prefix"])
    for j, image in enumerate(dataset[TWO_VIEWS_SAMPLE].images):
        assert f"image {j}: {image.width}×{image.height} {image.format} {image.mode}, {len(image.data):,} bytes" in page
    assert "planted.parquet row 5" in page
    assert 'class="text cfg"' in page and 'class="element loss"' in page  # CFG and loss spans marked


def test_text_only_samples_show_in_the_grid_without_an_image(planted):
    page = get(planted, f"/dataset/{NAME}/samples").text
    assert page.count('class="cell"') == 48 and page.count("text only") == 1
    assert f'href="/dataset/{NAME}/sample/{TEXT_ONLY_SAMPLE}"' in page
    assert PLANTED_WORD not in page  # the planted caption is on the second page
    assert PLANTED_WORD in get(planted, f"/dataset/{NAME}/samples?page=1").text


def test_planted_markup_is_escaped_on_every_page_that_shows_it(planted):
    for url in (f"/dataset/{NAME}/samples?page=1", f"/dataset/{NAME}/sample/{PLANTED_SAMPLE}",
                f"/dataset/{NAME}/search?q={PLANTED_WORD}"):
        page = get(planted, url).text
        assert "<script>" not in page and "<b>bold</b>" not in page
        assert "&lt;script&gt;" in page


def test_search_finds_the_planted_caption_and_says_how_many_samples_it_scanned(planted):
    page = get(planted, f"/dataset/{NAME}/search?q={PLANTED_WORD.upper()}").text
    assert f"Scanned samples 0 to {SAMPLES - 1} of {SAMPLES} ({SAMPLES} samples)" in page
    assert f'href="/dataset/{NAME}/sample/{PLANTED_SAMPLE}"' in page and "1 match." in page


def test_search_is_bounded_and_continues_where_it_stopped(planted):
    dataset, tokenizer = MMIDXDataset(planted["prefix"]), planted["catalog"].tokenizer(NAME)[0]
    first = search_texts(dataset, tokenizer, PLANTED_WORD, 0, max_samples=50)
    assert (first.start, first.end, first.hits, first.complete) == (0, 50, [], False)
    rest = search_texts(dataset, tokenizer, PLANTED_WORD, first.end, max_samples=50)
    assert (rest.end, rest.complete, [sample for sample, _ in rest.hits]) == (SAMPLES, True, [PLANTED_SAMPLE])
    assert rest.hits[0][1] == PLANTED_CAPTION


def test_images_are_sent_as_stored_or_re_encoded_when_browsers_cannot_show_them(planted):
    dataset = MMIDXDataset(planted["prefix"])
    stored = get(planted, f"/dataset/{NAME}/sample/0/image/0")
    assert stored.content == bytes(dataset[0].image(0).data) and stored.headers["content-type"] == "image/jpeg"
    tiff = get(planted, f"/dataset/{NAME}/sample/{TIFF_SAMPLE}/image/0")
    record = dataset[TIFF_SAMPLE].image(0)
    assert record.format == "TIFF" and tiff.headers["content-type"] == "image/png"
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(tiff.content))),
                          np.asarray(Image.open(io.BytesIO(bytes(record.data))).convert("RGB")))
    thumb = Image.open(io.BytesIO(get(planted, f"/dataset/{NAME}/sample/{TIFF_SAMPLE}/thumb/0").content))
    assert thumb.format == "JPEG" and max(thumb.size) <= THUMBNAIL_SIDE


def test_packs_list_planned_tokens_that_the_index_counted_and_the_pack_pages_build(planted):
    packs = planted["catalog"].pack_index()
    assert int(packs.tokens.sum()) == packs.index.stats["tokens"]
    page = get(planted, "/packs").text
    for k in range(len(packs.index)):
        pack = get(planted, f"/pack/{k}").text
        shown = re.search(r"<p>([\d,]+) tokens in ([\d,]+) samples", pack)
        samples = packs.index.items(k)
        assert int(shown[1].replace(",", "")) == int(packs.tokens[k])  # no dropout: the batch is the plan
        assert int(shown[2]) == len(samples) and f'<a href="/pack/{k}">pack {k}</a>' in page
        splits = sum(len(re.findall(r"\w+:\w+:[\d,]+", row)) for row in re.findall(r"<tr>.*?</tr>", pack))
        assert pack.count('class="split"') == splits  # a hover target per split of the pack
        for item in samples:
            assert f'href="/dataset/{NAME}/sample/{item.sample}"' in pack


@pytest.mark.parametrize("url", [
    f"/dataset/{NAME}/sample/{SAMPLES}", f"/dataset/{NAME}/sample/99999999999999999999999999",
    f"/dataset/{NAME}/sample/-1", f"/dataset/{NAME}/sample/1e3", f"/dataset/{NAME}/sample/%D9%A3",
    f"/dataset/{NAME}/sample/0/image/1", f"/dataset/{NAME}/sample/{TEXT_ONLY_SAMPLE}/thumb/0",
    f"/dataset/{NAME}/samples?page=2", f"/dataset/{NAME}/samples?page=-1", f"/dataset/{NAME}/samples?page=x",
    f"/dataset/{NAME}/search?q=a&start=abc", "/dataset/unknown/samples", "/pack/999", "/pack/-1", "/packs?page=9",
    "/nothing/here",
])
def test_bad_names_and_numbers_are_404_pages(planted, url):
    page = get(planted, url, 404)
    assert page.headers["content-type"].startswith("text/html") and "<h1>404" in page.text


TRAVERSALS = ["/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/%252e%252e/%252e%252e/etc/passwd",
              "/dataset/..%2f..%2fetc%2fpasswd/samples", "/dataset/%2e%2e/samples", "/dataset/%c0%ae%c0%ae/samples",
              f"/dataset/{NAME}/sample/0/../../../../etc/passwd", "//etc/passwd",
              "/dataset/..\\..\\etc\\passwd/samples",
              "/style.css/../../etc/passwd", f"/dataset/{NAME}/sample/0/image/..%2f..%2f..%2fetc%2fpasswd",
              "/etc/passwd%00.css", f"/dataset/{NAME}/..%2f{NAME}.meta.json"]


def raw_get(url: str, path: str) -> bytes:
    """The whole response to ``GET path`` sent as written (no client normalises it)."""
    host, port = url.split("//")[1].strip("/").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := connection.recv(1 << 16):
            data += chunk
    return data


def test_traversal_attempts_get_the_404_page_and_no_file_content(planted):
    meta = (planted["prefix"].parent / "planted.meta.json").read_bytes()
    with serving(planted["catalog"]) as url:
        for path in TRAVERSALS:
            response = raw_get(url, path)
            assert response.startswith(b"HTTP/1.1 404 "), (path, response[:200])
            assert b"root:" not in response and meta[:40] not in response and b"Traceback" not in response


def test_200_concurrent_requests_are_all_answered_within_a_bound(planted):
    paths = ["/", f"/dataset/{NAME}/samples", "/packs", "/pack/0", "/style.css"]
    paths += [f"/dataset/{NAME}/sample/{i % SAMPLES}" for i in range(60)]
    paths += [f"/dataset/{NAME}/sample/{i % SAMPLES}/thumb/0" for i in range(60) if i % SAMPLES != TEXT_ONLY_SAMPLE]
    paths = (paths * 2)[:200]

    async def fetch_all(url):
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
            return await asyncio.gather(*(client.get(path) for path in paths))

    with serving(planted["catalog"]) as url:
        start = time.perf_counter()
        responses = asyncio.run(fetch_all(url))
        seconds = time.perf_counter() - start
    assert [r.status_code for r in responses] == [200] * 200
    assert seconds < 30, f"200 concurrent requests took {seconds:.1f} s"


def test_a_request_over_the_time_limit_is_answered_503(planted):
    client = TestClient(create_app(planted["catalog"], allowed_hosts=["testserver"], time_limit=0.0))
    response = client.get(f"/dataset/{NAME}/sample/1")
    assert response.status_code == 503 and "reload it in a moment" in response.text


def test_requests_naming_another_host_are_refused(planted):
    client = TestClient(create_app(planted["catalog"]))  # loopback names only, as mmidx view serves
    assert client.get("/", headers={"Host": "attacker.example"}).status_code == 400
    assert client.get("/", headers={"Host": "127.0.0.1:8765"}).status_code == 200


def test_every_response_carries_a_script_free_content_security_policy(planted):
    for url in ("/", f"/dataset/{NAME}/sample/0/thumb/0", "/nothing"):
        policy = planted["client"].get(url).headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy


def test_mmidx_view_listens_on_loopback_by_default_and_prints_its_url(planted):
    assert build_parser().parse_args(["view", "x"]).host == "127.0.0.1"
    process = subprocess.Popen([sys.executable, "-m", "mmidx.cli", "view", str(planted["yaml"]), "--port", "0"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        url = re.search(r"http://\S+/", line)[0]
        assert url.startswith("http://127.0.0.1:") and "1 dataset at" in line  # the bound socket's own address
        assert httpx.get(url + f"dataset/{NAME}/sample/0", timeout=30).status_code == 200
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert "warning" not in stderr and "Traceback" not in stderr


def test_mmidx_view_warns_when_it_listens_beyond_loopback(planted):
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    process = subprocess.Popen([sys.executable, "-m", "mmidx.cli", "view", str(planted["prefix"]), "--host",
                                "0.0.0.0", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().startswith("mmidx view: 1 dataset at http://0.0.0.0:")
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=30)
    assert stderr.startswith("mmidx view: warning: listening on 0.0.0.0")


def test_mmidx_view_without_the_web_stack_says_what_to_install_in_one_line(planted):
    code = ("import sys; sys.modules['starlette'] = None; from mmidx.cli import main; "
            f"sys.exit(main(['view', {str(planted['prefix'])!r}]))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.strip().splitlines() == ['mmidx view: mmidx view needs Starlette and uvicorn: '
                                                  'pip install "mmidx[view]"']


def test_importing_mmidx_and_its_command_line_does_not_import_the_web_stack():
    code = ("import json, sys, mmidx, mmidx.cli; "
            "print(json.dumps(sorted(m for m in ('starlette', 'uvicorn') if m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert json.loads(result.stdout) == []


def test_integer_histogram_of_the_widest_int32_range_does_not_overflow():
    values = np.array([-(2**31), 0, 2**31 - 1], dtype=np.int32)
    histogram = integer_histogram("extremes", values, bars=4)
    assert histogram.counts == [1, 0, 1, 1] and histogram.labels[0].startswith("-2,147,483,648–")


def structure_verdict(catalog, name):
    """The catalog's structure verdict of ``name``, once its background check has finished."""
    deadline = time.monotonic() + 60
    while (verdict := catalog.structure(name)) is None:
        assert time.monotonic() < deadline, "the structure check did not finish in 60 s"
        time.sleep(0.05)
    return verdict


def test_the_overview_says_the_structure_is_sound_once_it_is_checked(planted):
    assert structure_verdict(planted["catalog"], NAME) == "sound"
    assert 'Structure: <span class="ok">sound</span>' in get(planted, "/").text


def test_a_broken_index_is_named_on_the_overview_and_its_samples_are_refused_in_one_line(planted, tmp_path):
    for path in planted["prefix"].parent.glob("planted.*"):
        shutil.copy(path, tmp_path / path.name)
    prefix = tmp_path / "planted"
    idx = fmt.file_path(prefix, "idx")
    header, data = fmt.read_token_index_header(idx), bytearray(idx.read_bytes())
    second = header.documents_offset + 8 * 2  # document_indices[2], made smaller than document_indices[1]
    data[second:second + 8] = (0).to_bytes(8, "little")
    idx.write_bytes(bytes(data))
    catalog = Catalog([str(prefix)])
    client = TestClient(create_app(catalog, allowed_hosts=["testserver"]))
    assert client.get("/").status_code == 200
    assert "document indices decrease" in structure_verdict(catalog, NAME)
    page = client.get("/").text
    assert 'Structure: <span class="bad">BROKEN</span>' in page and "document indices decrease" in page
    sample = client.get(f"/dataset/{NAME}/sample/1")
    assert sample.status_code == 500 and "cannot be read" in sample.text and "Traceback" not in sample.text


def test_mmidx_view_refuses_a_port_it_cannot_listen_on_in_one_line(planted, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["view", str(planted["prefix"]), "--port", str(port)]) == 1
    assert capsys.readouterr().err == (f"mmidx view: listening on 127.0.0.1:{port} is in use: pick another --port "
                                       "(0: any free one)\n")
    with pytest.raises(SystemExit) as usage:
        main(["view", str(planted["prefix"]), "--port", "99999"])
    assert usage.value.code == 2 and "'99999' is not a port" in capsys.readouterr().err


def test_the_sample_page_names_its_precached_encodings_and_their_record_shapes(planted, tmp_path):
    for path in planted["prefix"].parent.glob("planted.*"):
        shutil.copy(path, tmp_path / path.name)
    prefix = tmp_path / "planted"
    precache(str(prefix), Job("tx", "support.encoders:text", modality="text", dtype="fp32"), progress=False)
    client = TestClient(create_app(Catalog([str(prefix)]), allowed_hosts=["testserver"]))
    page = client.get(f"/dataset/{NAME}/sample/{TWO_VIEWS_SAMPLE}").text
    texts = MMIDXDataset(prefix)[TWO_VIEWS_SAMPLE].texts
    shapes = ", ".join(str((len(ids), 6)) for ids in texts)  # TinyText: (tokens, 6) per text
    assert "tx: text encoding by support.encoders:text (fp32, " in page
    assert f"this sample&#x27;s records: {shapes}" in page
    assert "Precached encoding <b>tx</b>" in client.get("/").text
