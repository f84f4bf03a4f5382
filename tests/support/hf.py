"""Hugging Face datasets made with ``datasets`` itself, as users have them: an ``Image`` column and captions."""

import os
from collections.abc import Sequence

from support.sources import image_bytes

IMAGES = [(64, 48, "RGB", "JPEG"), (33, 70, "RGBA", "PNG"), (50, 50, "P", "PNG"), (40, 24, "RGB", "JPEG"),
          (24, 32, "L", "PNG"), (48, 48, "RGB", "WEBP")]
CAPTIONS = [["a cat on a mat", "a small cat"], ["blue sky"], [], ["a red car", "car on a river", "red car photo"],
            ["tree house in the green"], ["a dog with a small tree"]]


def t2i_rows(count: int = len(IMAGES), seed: int = 0) -> list[dict]:
    """Rows of an image (``{bytes, path}``), a list of captions, a short caption and a score."""
    rows = []
    for i in range(count):
        width, height, mode, fmt = IMAGES[i % len(IMAGES)]
        captions = CAPTIONS[i % len(CAPTIONS)]
        rows.append({"image": {"bytes": image_bytes(width, height, mode, fmt, seed=seed + i), "path": f"{i}.img"},
                     "captions": captions, "caption": captions[0] if captions else "", "score": i / 2})
    return rows


def t2i_features():
    import datasets

    return datasets.Features({"image": datasets.Image(), "captions": datasets.List(datasets.Value("string")),
                              "caption": datasets.Value("string"), "score": datasets.Value("float64")})


def t2i_dataset(rows: Sequence[dict]):
    """A ``datasets.Dataset`` of :func:`t2i_rows`-shaped rows."""
    import datasets

    return datasets.Dataset.from_list(list(rows), features=t2i_features())


def conversation_dataset(seed: int = 0):
    """LLaVA rows with an image list column: two images, one image, none (text only)."""
    import datasets

    def turns(*pairs):
        return [{"from": speaker, "value": value} for speaker, value in pairs]

    rows = [
        {"conversations": turns(("human", "<image>\n<image> what differs?"), ("gpt", "the colour of the car")),
         "images": [image_bytes(40, 30, "RGB", "PNG", seed=seed), image_bytes(30, 40, "RGB", "JPEG", seed=seed + 1)]},
        {"conversations": turns(("human", "what is this? <image>"), ("gpt", "a tree house"), ("human", "sure?"),
                                ("gpt", "yes")), "images": [image_bytes(32, 32, "RGBA", "PNG", seed=seed + 2)]},
        {"conversations": turns(("human", "say something"), ("gpt", "a small river")), "images": []},
    ]
    features = datasets.Features({"conversations": datasets.List({"from": datasets.Value("string"),
                                                                  "value": datasets.Value("string")}),
                                  "images": datasets.List(datasets.Image())})
    return datasets.Dataset.from_list(rows, features=features)


def save(dataset, folder: str | os.PathLike) -> str:
    """``save_to_disk`` without its progress bar (it writes to stderr, which tests read); returns the folder."""
    import datasets

    datasets.disable_progress_bars()
    dataset.save_to_disk(os.fspath(folder))
    return os.fspath(folder)
