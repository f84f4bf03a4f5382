"""Factories for small datasets that tests build from scratch."""

from __future__ import annotations

import io
from dataclasses import dataclass, field

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from mmidx.ingest.writer import DatasetBuilder
from mmidx.sources.elements import Element, StoredImage

KINDS = ("text", "vae_image", "vit_image")


@dataclass
class RawSample:
    """What a test appends, kept to compare with what is read back."""

    texts: list[list[int]]
    images: list[StoredImage]
    views: list[list[Element]]
    origin: tuple[int, int] = (-1, -1)
    extra: dict = field(default_factory=dict)


@st.composite
def raw_samples(draw, max_tokens: int = 40, vocab: int = 1000) -> RawSample:
    """A random multimodal sample: 0-4 texts of 0..max_tokens ids, 0-3 images (random bytes: written with
    ``check_images=False``), 1-4 views."""
    texts = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=max_tokens), max_size=4))
    images = [
        StoredImage(draw(st.binary(max_size=64)), draw(st.integers(1, 4096)), draw(st.integers(1, 4096)),
                    draw(st.sampled_from(["JPEG", "PNG", "WEBP"])), draw(st.sampled_from(["RGB", "RGBA", "L"])),
                    draw(st.booleans()))
        for _ in range(draw(st.integers(0, 3)))
    ]
    kinds = [k for k, n in (("text", len(texts)), ("vae_image", len(images)), ("vit_image", len(images))) if n]
    views = []
    for _ in range(draw(st.integers(1, 4))):
        view = []
        length = draw(st.integers(0, 6 if kinds else 0))
        for position in range(length):  # whole splits, as the packer needs (mmidx.read.invariants.split_problem)
            kind = draw(st.sampled_from(kinds))
            split_start = position == 0 or view[-1].split_end
            split_end = position == length - 1 or draw(st.booleans())
            count = len(texts) if kind == "text" else len(images)
            view.append(Element(
                kind, draw(st.integers(0, count - 1)), loss=draw(st.booleans()), enable_cfg=draw(st.booleans()),
                special_token_loss=draw(st.booleans()),
                special_token_label=draw(st.one_of(st.none(), st.integers(0, vocab - 1))),
                split_start=split_start, split_end=split_end,
                frame_delta=draw(st.one_of(st.none(), st.integers(-5, 50))), img_num=draw(st.integers(1, 12))))
        views.append(view)
    extra = draw(st.one_of(st.just({}), st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text()),
                                                        max_size=3)))
    return RawSample(texts, images, views, (draw(st.integers(-1, 0)), draw(st.integers(0, 10**12))), extra)


def build(prefix, samples: list[RawSample], vocab: int = 1000, **kwargs) -> None:
    """Write ``samples`` as a multimodal dataset at ``prefix``."""
    with DatasetBuilder(prefix, vocab_size=vocab, **kwargs) as builder:
        source = builder.source_id("input.parquet")
        for sample in samples:
            origin = (source if sample.origin[0] >= 0 else -1, sample.origin[1])
            builder.add_sample(sample.texts, sample.images, sample.views, origin, sample.extra)
        builder.finalize()


def assert_sample_equal(read, raw: RawSample) -> None:
    """A read-back sample equals what was appended: texts, images, and every view's plan."""
    assert [t.tolist() for t in read.texts] == raw.texts
    assert read.num_images == len(raw.images)
    for j, image in enumerate(raw.images):
        got = read.image(j)
        assert bytes(got.data) == image.data
        assert (got.width, got.height, got.format, got.mode, got.has_transparency) == image[1:]
    assert read.extra == raw.extra
    assert read.num_views == len(raw.views)
    for v, view in enumerate(raw.views):
        expected = np.array([element.record() for element in view], dtype=read.elements(v).dtype)
        assert read.elements(v).tobytes() == expected.tobytes()


def png_bytes(width: int, height: int, color: tuple[int, ...] = (200, 30, 90), mode: str = "RGB") -> bytes:
    """A real, tiny (one-colour) PNG, so that ``mmidx verify`` can probe and decode it."""
    stream = io.BytesIO()
    Image.new(mode, (width, height), color).save(stream, format="PNG")
    return stream.getvalue()


def small_dataset(prefix, seed: int = 0, count: int = 3) -> list[RawSample]:
    """A deterministic little dataset with every element kind; returns what was written."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        texts = [rng.integers(0, 1000, rng.integers(1, 8)).tolist() for _ in range(2)]
        images = [StoredImage(png_bytes(64 + i, 48, tuple(rng.integers(0, 256, 3).tolist())), 64 + i, 48, "PNG", "RGB")]
        views = [[Element("vae_image", 0, enable_cfg=True), Element("vit_image", 0, enable_cfg=True),
                  Element("text", v), Element("vae_image", 0, loss=True)] for v in range(2)]
        samples.append(RawSample(texts, images, views, (0, i)))
    build(prefix, samples)
    return samples
