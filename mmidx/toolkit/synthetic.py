"""Generate a small BAGEL-format corpus offline: the demo's and the benchmarks' sample data.

Writes, under one folder, the raw inputs BAGEL's loaders read (and mmidx's builders take), in the
layout of the shared BAGEL side-by-side harness, so both read the very same files:

=====================================  =====================================================
``t2i/chunk_{i}.parquet``              ``image`` (JPEG bytes), ``captions`` (JSON dict)
``editing/seedxedit_multi/*.parquet``  ``image_list`` (JPEG bytes), ``instruction_list``
``editing/parquet_info/*.json``        BAGEL's parquet info (row groups and rows per file)
``vlm/images/*.jpg``, ``vlm/sft.jsonl``  LLaVA-style conversations with ``<image>``
``vlm/images/videos/*.mp4``            short clips for ``<video>`` conversations (optional)
``tokenizer/``                         a byte-level BPE with Qwen2's special-token names
``meta.json``                          the :class:`CorpusSpec` and ``files``: every file written
=====================================  =====================================================

Images are photo-like (smooth colour fields, shapes, mild noise) so JPEG sizes and decode costs
resemble real data. Nothing is downloaded.
"""

from __future__ import annotations

import io
import json
import os
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]


@dataclass(frozen=True)
class CorpusSpec:
    """How much of each source type to generate, and the image size."""

    image_size: int = 512
    quality: int = 90
    t2i_files: int = 2
    t2i_rows: int = 32
    edit_files: int = 2
    edit_rows: int = 16
    edit_images: int = 3
    vlm_lines: int = 64
    vlm_images: int = 16
    vlm_videos: int = 0
    row_group: int = 8
    seed: int = 0


def photo_jpeg(rng: random.Random, width: int, height: int, quality: int) -> bytes:
    """A photo-like JPEG: an upsampled smooth colour field with shapes and mild noise."""
    noise = np.random.default_rng(rng.randrange(1 << 31))
    image = Image.fromarray(noise.integers(0, 256, (6, 6, 3), dtype=np.uint8)).resize((width, height),
                                                                                       Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(4, 12)):
        x0, y0 = rng.randrange(width), rng.randrange(height)
        box = [x0, y0, x0 + rng.randrange(20, max(21, width // 2)), y0 + rng.randrange(20, max(21, height // 2))]
        colour = tuple(rng.randrange(256) for _ in range(3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=colour)
    pixels = np.asarray(image.filter(ImageFilter.GaussianBlur(1.5))).astype(np.int16)
    pixels = np.clip(pixels + noise.normal(0, 6, pixels.shape), 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _vocabulary(rng: random.Random, size: int = 3000) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))))
    return sorted(words)


def _sentence(rng: random.Random, vocabulary: list[str], low: int, high: int) -> str:
    return " ".join(rng.choice(vocabulary) for _ in range(rng.randint(low, high))).capitalize() + "."


def train_tokenizer(directory: str | os.PathLike, corpus: list[str], vocab_size: int = 8192) -> Path:
    """Train a byte-level BPE with Qwen2's special-token names and save it as a Hugging Face tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus, trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>")
    wrapped.save_pretrained(os.fspath(directory))
    tokenizer.save(os.path.join(directory, "bpe.json"))  # the raw tokenizers file BAGEL's harness loads
    return Path(directory)


def _write_video(path: Path, rng: random.Random, frames: int, size: int) -> None:
    import av

    with av.open(os.fspath(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        base = np.random.default_rng(rng.randrange(1 << 31)).integers(0, 256, (size, size, 3), dtype=np.uint8)
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(np.roll(base, 4 * index, axis=1), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def write_corpus(out: str | os.PathLike, spec: CorpusSpec = CorpusSpec()) -> Path:
    """Write the corpus described by ``spec`` under ``out`` (see the module docstring for the layout)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(out)
    written: list[Path] = []  # every file, for meta.json
    rng = random.Random(spec.seed)
    vocabulary = _vocabulary(rng)
    corpus: list[str] = []

    def jpeg() -> bytes:
        return photo_jpeg(rng, spec.image_size, spec.image_size, spec.quality)

    (out / "t2i").mkdir(parents=True, exist_ok=True)
    for number in range(spec.t2i_files):
        images, captions = [], []
        for _ in range(spec.t2i_rows):
            images.append(jpeg())
            caption = {"caption_short": _sentence(rng, vocabulary, 8, 20),
                       "caption_long": " ".join(_sentence(rng, vocabulary, 10, 25) for _ in range(rng.randint(3, 6)))}
            corpus.extend(caption.values())
            captions.append(json.dumps(caption))
        table = pa.table({"image": pa.array(images, pa.binary()), "captions": pa.array(captions, pa.string())})
        pq.write_table(table, out / "t2i" / f"chunk_{number}.parquet", row_group_size=spec.row_group)
        written.append(out / "t2i" / f"chunk_{number}.parquet")

    edit_dir, info_dir = out / "editing" / "seedxedit_multi", out / "editing" / "parquet_info"
    edit_dir.mkdir(parents=True, exist_ok=True)
    info_dir.mkdir(parents=True, exist_ok=True)
    parquet_info = {}
    for number in range(spec.edit_files):
        image_lists, instruction_lists = [], []
        for _ in range(spec.edit_rows):
            image_lists.append([jpeg() for _ in range(spec.edit_images)])
            steps = [[_sentence(rng, vocabulary, 5, 15) for _ in range(rng.randint(1, 3))]
                     for _ in range(spec.edit_images - 1)]
            corpus.extend(text for step in steps for text in step)
            instruction_lists.append(steps)
        path = edit_dir / f"chunk_{number}.parquet"
        table = pa.table({"image_list": pa.array(image_lists, pa.list_(pa.binary())),
                          "instruction_list": pa.array(instruction_lists, pa.list_(pa.list_(pa.string())))})
        pq.write_table(table, path, row_group_size=max(1, spec.row_group // 2))
        written.append(path)
        metadata = pq.ParquetFile(path).metadata
        parquet_info[str(path.resolve())] = {"num_row_groups": metadata.num_row_groups, "num_rows": metadata.num_rows}
    (info_dir / "seedxedit_multi.json").write_text(json.dumps(parquet_info))
    written.append(info_dir / "seedxedit_multi.json")

    vlm_dir = out / "vlm"
    (vlm_dir / "images").mkdir(parents=True, exist_ok=True)
    for number in range(spec.vlm_images):
        (vlm_dir / "images" / f"img_{number}.jpg").write_bytes(jpeg())
        written.append(vlm_dir / "images" / f"img_{number}.jpg")
    if spec.vlm_videos:
        (vlm_dir / "images" / "videos").mkdir(exist_ok=True)
        for number in range(spec.vlm_videos):
            _write_video(vlm_dir / "images" / "videos" / f"clip_{number}.mp4", rng, frames=24,
                         size=min(spec.image_size, 256))
            written.append(vlm_dir / "images" / "videos" / f"clip_{number}.mp4")
    with open(vlm_dir / "sft.jsonl", "w") as stream:
        for line in range(spec.vlm_lines):
            conversation = []
            video = spec.vlm_videos and line % 8 == 7
            for turn in range(rng.randint(1, 3)):
                question = _sentence(rng, vocabulary, 6, 25)
                answer = " ".join(_sentence(rng, vocabulary, 8, 20) for _ in range(rng.randint(1, 8)))
                corpus.extend([question, answer])
                media = ("<video>\n" if video else "<image>\n") if turn == 0 else ""
                conversation += [{"from": "human", "value": media + question}, {"from": "gpt", "value": answer}]
            record: dict[str, object] = {"id": line, "conversations": conversation}
            if video:
                record["video"] = f"videos/clip_{rng.randrange(spec.vlm_videos)}.mp4"
            else:
                record["image"] = f"img_{rng.randrange(spec.vlm_images)}.jpg"
            stream.write(json.dumps(record) + "\n")

    written.append(vlm_dir / "sft.jsonl")
    written += sorted(path for path in train_tokenizer(out / "tokenizer", corpus).iterdir() if path.is_file())
    files = sorted(path.relative_to(out).as_posix() for path in [*written, out / "meta.json"])
    (out / "meta.json").write_text(json.dumps({**asdict(spec), "files": files}, indent=1))
    return out
