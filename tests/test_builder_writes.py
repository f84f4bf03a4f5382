"""The builder's fast write path: write-behind, element records kept per Element, token arrays taken as given."""

import itertools
import pickle

import numpy as np
import pytest
from support.helpers import assert_sample_equal, build, small_dataset

from mmidx import format as fmt
from mmidx.ingest import writer as writer_module
from mmidx.ingest.writer import DatasetBuilder
from mmidx.io import libc
from mmidx.read.checks import verify
from mmidx.read.dataset import MMIDXDataset
from mmidx.sources.elements import Element, StoredImage


def test_write_behind_covers_every_byte_once_and_changes_no_byte(tmp_path, monkeypatch):
    samples = small_dataset(tmp_path / "default", seed=5, count=6)  # a few KiB: no write-behind at 16 MiB
    started = []
    real = libc.start_writeback

    def spy(fd, offset, length):
        started.append((fd, offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(writer_module._HashingWriter, "WRITE_BEHIND", 100)
    monkeypatch.setattr(libc, "start_writeback", spy)
    build(tmp_path / "behind", samples)
    assert len(started) > 4
    by_file = {}
    for fd, offset, length in started:
        by_file.setdefault(fd, []).append((offset, length))
    for ranges in by_file.values():  # back to back from 0, each at least WRITE_BEHIND bytes
        assert ranges[0][0] == 0
        assert all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
        assert all(n >= 100 for _, n in ranges)
    for role in ("bin", "idx", "images", "plan"):
        assert fmt.file_path(tmp_path / "behind", role).read_bytes() == \
            fmt.file_path(tmp_path / "default", role).read_bytes()
    assert verify(tmp_path / "behind") == []
    for index, raw in enumerate(samples):
        assert_sample_equal(MMIDXDataset(tmp_path / "behind")[index], raw)


def test_an_element_record_is_kept_without_changing_equality_hash_or_pickling():
    element = Element("vae_image", 2, loss=True, special_token_label=7, frame_delta=3, img_num=2)
    twin = Element("vae_image", 2, loss=True, special_token_label=7, frame_delta=3, img_num=2)
    flags = fmt.FLAG_LOSS | fmt.FLAG_SPLIT_START | fmt.FLAG_SPLIT_END | fmt.FLAG_HAS_FRAME_DELTA
    assert element.record() == (fmt.VAE_IMAGE, flags, 2, 3, 7, 2)
    assert element.record() is element.record()
    assert element == twin and hash(element) == hash(twin) and repr(element) == repr(twin)
    assert pickle.loads(pickle.dumps(element)).record() == element.record()


@pytest.mark.parametrize(("element", "message"), [
    (Element("video", 0), "unknown element kind"),
    (Element("vae_image", 0, img_num=0), "img_num"),
    (Element("vae_image", 0, frame_delta=2**31), "int32"),
    (Element("text", 0, special_token_label=-(2**31) - 1), "int32"),
])
def test_a_bad_element_is_refused_every_time_it_is_added(tmp_path, element, message):
    image = StoredImage(b"\xff\xd8", 2, 2, "JPEG", "RGB")
    with DatasetBuilder(tmp_path / "ds", vocab_size=100) as builder:
        for _ in range(2):
            with pytest.raises(ValueError, match=message):
                builder.add_sample([[1]], [image], [[element]])
        assert builder.num_samples == 0


def test_token_arrays_of_any_layout_are_written_as_their_values(tmp_path):
    base = np.arange(40, dtype=np.uint16)
    documents = [base[::2], base[:12].reshape(3, 4), base[5:9].astype(np.uint8), base[:3]]
    with DatasetBuilder(tmp_path / "text", kind="text", vocab_size=100) as builder:
        for document in documents:
            builder.add_document([document])
        builder.finalize()
    dataset = MMIDXDataset(tmp_path / "text")
    assert [dataset[i].texts[0].tolist() for i in range(len(dataset))] == \
        [list(range(0, 40, 2)), list(range(12)), [5, 6, 7, 8], [0, 1, 2]]
