"""A downloaded image is stored only if it decodes: JPEGs are checked by a scaled libjpeg-turbo decode
(simplejpeg, 1/8 of each side, luma only) that still reads every entropy-coded byte, so truncated and
corrupt JPEGs are ``fetch:decode_error`` and the check agrees with the reader's own JPEG decoder."""

import io

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image
from support.http_faults import FaultServer
from support.sources import build

from mmidx.fetch.ledger import ledger_path
from mmidx.images.decode import ImageError, decode_rgb, decode_rgb_pixels
from mmidx.sources import Skipped, SourceContext, SourceOptions
from mmidx.sources.urls import ingest_fetched


def _jpeg(mode: str = "RGB", progressive: bool = False, size: tuple[int, int] = (160, 120)) -> bytes:
    rng = np.random.default_rng(7)
    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, "JPEG", quality=90, progressive=progressive)
    return out.getvalue()


def _flipped(data: bytes) -> bytes:
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    return bytes(corrupt)


def _zeroed(data: bytes) -> bytes:
    corrupt = bytearray(data)
    corrupt[len(data) // 2:len(data) // 2 + 50] = bytes(50)
    return bytes(corrupt)


def _last_scan_dropped(data: bytes) -> bytes:
    """A progressive JPEG cut just before its last scan (no end-of-image marker): a download cut short."""
    return data[:data.rfind(b"\xff\xda")]


# (name, the bytes): every one must be refused
BROKEN = [
    ("baseline cut at 60%", lambda: _jpeg()[:int(len(_jpeg()) * 0.6)]),
    ("baseline without its end-of-image marker", lambda: _jpeg()[:-2]),
    ("baseline missing its last 200 bytes", lambda: _jpeg()[:-200]),
    ("progressive cut at 60%", lambda: _jpeg(progressive=True)[:int(len(_jpeg(progressive=True)) * 0.6)]),
    ("progressive missing its last scan", lambda: _last_scan_dropped(_jpeg(progressive=True))),
    ("greyscale cut at 60%", lambda: _jpeg("L")[:int(len(_jpeg("L")) * 0.6)]),
    ("CMYK cut at 60%", lambda: _jpeg("CMYK")[:int(len(_jpeg("CMYK")) * 0.6)]),
    ("baseline with a byte flipped mid-stream", lambda: _flipped(_jpeg())),
    ("baseline with 50 bytes zeroed mid-stream", lambda: _zeroed(_jpeg())),
    ("progressive with 50 bytes zeroed mid-stream", lambda: _zeroed(_jpeg(progressive=True))),
]
GOOD = [("baseline", lambda: _jpeg()), ("progressive", lambda: _jpeg(progressive=True)),
        ("greyscale", lambda: _jpeg("L")), ("CMYK", lambda: _jpeg("CMYK")),
        ("4:4:4 large", lambda: _jpeg(size=(1000, 700)))]
# damaged in a way no decoder notices (the flipped bit still decodes, to other pixels): stored, as the reader reads it
UNNOTICED = [("progressive with a byte flipped mid-stream", lambda: _flipped(_jpeg(progressive=True)))]


def _context() -> SourceContext:
    return SourceContext(None, SourceOptions())


@pytest.mark.parametrize("name, make", BROKEN, ids=[name for name, _ in BROKEN])
def test_a_truncated_or_corrupt_jpeg_is_a_decode_error(name, make):
    with pytest.raises(Skipped) as skipped:
        ingest_fetched(make(), _context())
    assert skipped.value.reason == "fetch:decode_error"


@pytest.mark.parametrize("name, make", GOOD, ids=[name for name, _ in GOOD])
def test_a_whole_jpeg_is_stored_as_served_with_its_size(name, make):
    data = make()
    image = ingest_fetched(data, _context())
    assert image.data == data
    assert (image.width, image.height) == Image.open(io.BytesIO(data)).size


@pytest.mark.parametrize("name, make", BROKEN + GOOD + UNNOTICED, ids=[name for name, _ in BROKEN + GOOD + UNNOTICED])
def test_the_check_stores_exactly_the_jpegs_the_reader_decodes(name, make):
    data = make()
    try:
        ingest_fetched(data, _context())
        stored = True
    except Skipped:
        stored = False
    try:
        decode_rgb_pixels(data)
        readable = True
    except ImageError:
        readable = False
    assert stored == readable


def test_truncated_jpegs_fail_pils_full_decode_too():
    """The truncations are real ones: PIL's full decode (BAGEL's reader) refuses them as well (a JPEG whose
    entropy data is whole but lacks its end-of-image marker PIL pads silently; simplejpeg, the reader's
    JPEG decoder, refuses it, and so does the check)."""
    for name, make in BROKEN:
        if "cut" in name or "missing" in name:
            with pytest.raises(ImageError):
                decode_rgb(make())


def test_a_progressive_jpeg_whose_last_scan_is_dropped_but_which_ends_properly_is_an_image():
    """Refinement scans are optional: without the last one (end-of-image marker kept) the JPEG is valid,
    and PIL decodes it fully too, so it is stored."""
    data = _jpeg(progressive=True)
    fewer_scans = data[:data.rfind(b"\xff\xda")] + b"\xff\xd9"
    decode_rgb(fewer_scans)
    assert ingest_fetched(fewer_scans, _context()).data == fewer_scans


def test_a_build_from_urls_counts_a_truncated_jpeg_served_whole_as_a_decode_error(tmp_path):
    """The server sends the truncated file with its own Content-Length: the download succeeds, the check fails."""
    import pyarrow as pa

    server = FaultServer()
    server.add_image("whole", _jpeg())
    server.add_image("cut", _last_scan_dropped(_jpeg(progressive=True)))
    server.add_image("flipped", _flipped(_jpeg()))
    try:
        urls = [server.url(f"/image/{name}") for name in ("whole", "cut", "flipped")]
        table = tmp_path / "urls.parquet"
        pq.write_table(pa.table({"URL": urls, "TEXT": ["a", "b", "c"]}), table)
        dataset, report = build("urls", [table], tmp_path / "out", url_column="URL", caption_columns=("TEXT",),
                                fetch_timeout=5.0, fetch_retries=0)
    finally:
        server.stop()
    classes = pq.read_table(ledger_path(tmp_path / "out"), columns=["class"]).column("class").to_pylist()
    assert classes == ["ok", "decode_error", "decode_error"]
    assert report.data["skips"]["fetch:decode_error"]["count"] == 2
    assert len(dataset) == 1 and bytes(dataset[0].image(0).data) == _jpeg()
