"""Only images every reader decodes are stored: ``DatasetBuilder`` refuses the others, a build counts them as
skipped rows, and ``verify --decode`` decodes as the loader does (simplejpeg in strict mode, not PIL)."""

import pytest
from support.helpers import png_bytes
from support.images import encode, junk_before_the_end_marker, noise
from support.packing import config_of
from support.sources import tokenizer_dir

import mmidx
from mmidx.images.decode import ImageError
from mmidx.index.pack_index import build_pack_index
from mmidx.ingest.writer import DatasetBuilder
from mmidx.pack.builder import PackBuilder
from mmidx.read.checks import verify
from mmidx.sources.elements import Element, StoredImage

SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}
GROUP = {"image_transform_args": {"image_stride": 16, "max_image_size": 64, "min_image_size": 32},
         "is_mandatory": True}


def _jpeg(seed: int = 0) -> bytes:
    return encode(noise("RGB", 64, 48, seed=seed), "JPEG")


def _add(builder: DatasetBuilder, image: StoredImage) -> None:
    builder.add_sample([[5, 6]], [image], [[Element("text", 0), Element("vae_image", 0, loss=True)]])


def test_the_builder_refuses_a_jpeg_the_loader_cannot_decode_and_names_the_sample(tmp_path):
    with DatasetBuilder(tmp_path / "ds", vocab_size=100, special_tokens=SPECIAL) as builder:
        _add(builder, StoredImage(_jpeg(), 64, 48, "JPEG", "RGB"))
        with pytest.raises(ImageError, match=r"image 0 of sample 1: cannot decode JPEG image of 64x48 .*extraneous "
                                             r"bytes before marker 0xd9"):
            _add(builder, StoredImage(junk_before_the_end_marker(_jpeg(1)), 64, 48, "JPEG", "RGB"))
        _add(builder, StoredImage(_jpeg(2), 64, 48, "JPEG", "RGB"))  # nothing of the refused one was written
        builder.finalize()
    assert verify(tmp_path / "ds", decode=True) == []


def test_the_builder_refuses_a_stored_image_that_misdescribes_its_bytes(tmp_path):
    with DatasetBuilder(tmp_path / "ds", vocab_size=100) as builder:
        with pytest.raises(ImageError, match="its bytes are a 64x48 PNG RGB image without transparency, but its "
                                             "StoredImage says 64x48 PNG RGBA with transparency"):
            _add(builder, StoredImage(png_bytes(64, 48), 64, 48, "PNG", "RGBA", True))
        assert builder.num_samples == 0


def test_a_stored_jpeg_the_loader_refuses_fails_verify_decode_as_it_fails_the_pack(tmp_path):
    bad = junk_before_the_end_marker(_jpeg())
    with DatasetBuilder(tmp_path / "ds", vocab_size=100, special_tokens=SPECIAL, check_images=False) as builder:
        _add(builder, StoredImage(bad, 64, 48, "JPEG", "RGB"))  # as a writer without the check stored it
        builder.finalize()
    assert verify(tmp_path / "ds") == []  # its header is sound
    (problem,) = verify(tmp_path / "ds", decode=True)
    assert problem.startswith(f"{tmp_path / 'ds'}.images: image 0: cannot decode JPEG image of 64x48")
    assert "extraneous bytes before marker 0xd9" in problem
    config = config_of({"g": {"datasets": [str(tmp_path / "ds")], **GROUP}})
    index = build_pack_index(config, cache_dir=None)
    with pytest.raises(ValueError, match="extraneous bytes before marker 0xd9"):
        PackBuilder(config).build(0, index.items(0))


def test_a_build_counts_a_jpeg_the_loader_cannot_decode_as_a_skipped_row(tmp_path):
    images = [_jpeg(0), junk_before_the_end_marker(_jpeg(1)), _jpeg(2)]

    def sample(number):
        return {"texts": [f"photo {number}"], "images": [images[number]],
                "views": [Element("text", 0), Element("vae_image", 0, loss=True)]}

    report = mmidx.write(sample, range(3), tmp_path / "ds", tokenizer=tokenizer_dir(), max_skip_rate=0.5,
                         progress=False)
    assert report.data["samples"] == 2 and report.data["skipped"] == 1
    assert report.data["skips"]["undecodable_image"]["count"] == 1
    assert "extraneous bytes before marker 0xd9" in report.data["skips"]["undecodable_image"]["examples"][0]["detail"]
    assert verify(tmp_path / "ds", decode=True) == []
