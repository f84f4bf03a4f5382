"""The per-sample read path (``ds[i].text(0)``, ``ds[i].image(0)``) checks every offset it follows and builds
the same records as before: ImageTable and TokenStream, driven with arrays crafted to be wrong."""

import numpy as np
import pytest
from mmidx._reader import ImageTable
from support.helpers import small_dataset

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.read.dataset import ImageRecord, MMIDXDataset

DATA = memoryview(bytes(range(100)))


def _table(sample_image_offsets, image_offsets, widths=None, record=ImageRecord) -> ImageTable:
    images = len(image_offsets) - 1
    info = np.zeros(images, dtype=fmt.IMAGE_DTYPE)
    info["width"] = widths if widths is not None else 4
    info["height"], info["format"], info["mode"] = 3, fmt.IMAGE_FORMATS.index("PNG"), fmt.IMAGE_MODES.index("RGB")
    info["flags"][0] = fmt.IMAGE_FLAG_TRANSPARENCY
    return ImageTable("p", np.array(sample_image_offsets, dtype="<i8"), np.array(image_offsets, dtype="<i8"),
                      info, DATA, record)


def test_an_image_is_the_same_named_tuple_as_one_built_field_by_field():
    table = _table([0, 1, 2], [0, 10, 30])
    first, second = table.image(0, 0), table.image(1, 0)
    assert type(first) is ImageRecord
    assert first == ImageRecord(DATA[0:10], 4, 3, "PNG", "RGB", True)
    assert (second.width, second.height, second.format, second.mode, second.has_transparency) == (4, 3, "PNG", "RGB",
                                                                                                   False)
    assert bytes(second.data) == bytes(range(10, 30))


def test_an_image_table_refuses_a_record_type_that_is_not_a_tuple():
    with pytest.raises(TypeError, match="record must be a tuple type"):
        _table([0, 1], [0, 10], record=dict)


@pytest.mark.parametrize(("sample_image_offsets", "image_offsets", "message"), [
    ([0, 2, 1, 2], [0, 1, 2], r"p\.plan: sample_image_offsets\[1:3\] = \[2, 1\] is not a range inside \[0, 2\] "
                              r"\(sample 1\): corrupted"),
    ([0, 1, 2**63 - 1, 2], [0, 1, 2], r"sample_image_offsets\[1:3\] = \[1, 9223372036854775807\]"),
    ([0, 1, 2, 2], [0, 1, 2**62], r"p\.plan: image_offsets\[1:3\] = \[1, 4611686018427387904\] is not a range "
                                  r"inside \[0, 100\] \(sample 1\): corrupted"),
    ([0, 1, 2, 2], [0, 50, -1], r"image_offsets\[1:3\] = \[50, -1\]"),
])
def test_every_offset_an_image_read_follows_is_checked_without_overflow(sample_image_offsets, image_offsets,
                                                                        message):
    table = _table(sample_image_offsets, image_offsets)
    with pytest.raises(FormatError, match=message):
        table.image(1, 0)


def test_image_numbers_and_sizes_outside_the_table_are_refused():
    table = _table([0, 1, 2], [0, 10, 30], widths=[4, 0])
    with pytest.raises(IndexError, match="sample 2 out of range for 2 samples"):
        table.image(2, 0)
    with pytest.raises(IndexError, match="image 1 out of range: sample 0 has 1 images"):
        table.image(0, 1)
    with pytest.raises(IndexError, match="image -1 out of range"):
        table.image(0, -1)
    with pytest.raises(FormatError, match=r"image 1 \(sample 1\) has a size of 0x3"):
        table.image(1, 0)


def test_a_text_read_checks_the_document_range_it_follows(tmp_path):
    prefix = tmp_path / "ds"
    small_dataset(prefix)
    dataset = MMIDXDataset(prefix)
    assert dataset[1].text(1).tolist() == dataset.tokens.get(3).tolist()
    with pytest.raises(IndexError, match="document 3 out of range for 3 documents"):
        dataset.tokens.document_text(3, 0)
    with pytest.raises(IndexError, match="text 2 out of range: sample 1 has 2 texts"):
        dataset[1].text(2)
    header = fmt.read_token_index_header(fmt.file_path(prefix, "idx"))
    with open(fmt.file_path(prefix, "idx"), "r+b") as stream:
        stream.seek(header.documents_offset + 8)
        stream.write((2**40).to_bytes(8, "little"))
    with pytest.raises(FormatError, match=r"ds\.idx: document_indices\[0:2\] = \[0, 1099511627776\] is not a "
                                          r"range inside \[0, 6\] \(sample 0\): corrupted"):
        MMIDXDataset(prefix)[0].text(0)
