"""Datasets and transforms the precache tests and the Ray precache test share."""

import numpy as np

from mmidx.images.transform import ImageTransform
from mmidx.ingest.writer import DatasetBuilder
from mmidx.sources.elements import Element, StoredImage

VAE = ImageTransform(max_image_size=64, min_image_size=32, image_stride=16)


SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4}


SIZES = [(64, 48), (40, 70), (64, 48), (33, 33), (90, 40), (48, 64)]


def _noise_png(width, height, seed):
    import io

    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    stream = io.BytesIO()
    Image.fromarray(pixels).save(stream, format="PNG")
    return StoredImage(stream.getvalue(), width, height, "PNG", "RGB")


def make_datasets(folder):
    """A t2i dataset (caption, noised image) and an edit dataset (clean image, vit image, text, noised image)."""
    with DatasetBuilder(folder / "t2i", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for i, (width, height) in enumerate(SIZES):
            builder.add_sample([list(range(5, 9 + i))], [_noise_png(width, height, i)],
                               [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]])
        builder.finalize()
    with DatasetBuilder(folder / "edit", vocab_size=1000, special_tokens=SPECIAL) as builder:
        for i in range(4):
            images = [_noise_png(*SIZES[i], 10 + i), _noise_png(*SIZES[i + 1], 20 + i)]
            builder.add_sample([list(range(10, 14 + i))], images, [[
                Element("vae_image", 0, enable_cfg=True), Element("vit_image", 0, enable_cfg=True),
                Element("text", 0, loss=True), Element("vae_image", 1, loss=True, img_num=2)]])
        builder.finalize()
    return folder


def make_captioned(folder, tokenizer):
    """A t2i dataset whose captions are real text of ``tokenizer`` (recorded in its metadata)."""
    from support.sources import WORDS

    rng = np.random.default_rng(5)
    with DatasetBuilder(folder / "cap", vocab_size=tokenizer.vocab_size, tokenizer=tokenizer.identity,
                        special_tokens={k: v for k, v in tokenizer.special_tokens.items() if k != "eod"}) as builder:
        for i, (width, height) in enumerate(SIZES):
            caption = " ".join(rng.choice(WORDS, size=3 + i))
            builder.add_sample([tokenizer.encode(caption)], [_noise_png(width, height, i)],
                               [[Element("text", 0, enable_cfg=True), Element("vae_image", 0, loss=True)]])
        builder.finalize()
    return folder / "cap"
