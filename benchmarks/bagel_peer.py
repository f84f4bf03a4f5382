"""BAGEL's own data code beside mmidx, on one generated corpus: what bench_pack.py and tools/check_bagel.py share.

The corpus (:mod:`mmidx.toolkit.synthetic`: t2i parquet, edit parquet, vlm JSONL + images, a byte-level BPE) is
written once under a work folder and built into mmidx datasets there; BAGEL's ``data`` package (a checkout of
ByteDance-Seed/Bagel, imported unmodified) reads the same raw files with the same tokenizer, budgets and dropout.

BAGEL needs torchvision (only its PIL-based ``ToTensor``/``Normalize``/``resize``), decord and cv2 importable; on a
CPU-only torch, install them apart, ``pip install --target DIR --no-deps torchvision==0.28.0 decord
opencv-python-headless pandas``, and pass DIR as ``bagel_site``: an empty stand-in for
``torchvision._meta_registrations`` lets torchvision's Python parts import beside a CPU torch (BAGEL's data code
uses only its PIL-based parts; its compiled operators would not load).
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import yaml
from PIL import ImageFile

from mmidx.toolkit.demo import BAGEL_GROUPS
from mmidx.toolkit.synthetic import CorpusSpec, write_corpus

MODES = {"t2i": ["t2i_pretrain"], "edit": ["unified_edit"], "vlm": ["vlm_sft"],
         "mix": ["t2i_pretrain", "unified_edit", "vlm_sft"]}
BUDGETS = {"expected_num_tokens": 32768, "max_num_tokens": 36864, "max_num_tokens_per_sample": 16384,
           "prefer_buffer_before": 16384, "max_buffer_size": 50}
DROPOUT = {"text": 0.1, "vit": 0.3, "vae": 0.3}
GEOMETRY = {"vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16, "max_latent_size": 32}


def prepare(workdir: Path, image_size: int = 512, videos: bool = False) -> tuple[Path, Path]:
    """The raw corpus of ``image_size``² JPEGs and the mmidx datasets built from it (reused when present); with
    ``videos``, a smaller corpus whose every eighth vlm conversation is over a video clip."""
    from mmidx.ingest import build_from_config

    if videos:
        workdir = workdir / "videos"
        spec = CorpusSpec(t2i_files=2, t2i_rows=8, edit_files=2, edit_rows=4, vlm_lines=96, vlm_images=16,
                          vlm_videos=4)
    elif image_size == 512:
        spec = CorpusSpec(t2i_files=4, t2i_rows=64, edit_files=4, edit_rows=32, vlm_lines=256, vlm_images=64)
    else:  # larger images, fewer per pack: a corpus of a quarter of the samples still fills the packs timed
        workdir = workdir / f"size{image_size}"
        spec = CorpusSpec(image_size=image_size, t2i_files=4, t2i_rows=16, edit_files=4, edit_rows=8,
                          vlm_lines=64, vlm_images=16)
    raw = workdir / "raw"
    if not (raw / "meta.json").exists():
        write_corpus(raw, spec)
    datasets = workdir / "datasets"
    if not (datasets / "data.yaml").exists():
        (workdir / "bagel.yaml").write_text(yaml.safe_dump(BAGEL_GROUPS, sort_keys=False))
        (workdir / "dataset_info.yaml").write_text(yaml.safe_dump(dataset_info(raw)))
        # importing BAGEL's data package sets PIL's LOAD_TRUNCATED_IMAGES, which mmidx's build refuses (a truncated
        # image would be padded silently): the build runs with Pillow's default
        truncated, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
        try:
            build_from_config(workdir / "bagel.yaml", workdir / "dataset_info.yaml", datasets,
                              tokenizer=str(raw / "tokenizer"), workers=2, progress=False)
        finally:
            ImageFile.LOAD_TRUNCATED_IMAGES = truncated
    return raw, datasets


def dataset_info(raw: Path) -> dict[str, Any]:
    """BAGEL's ``DATASET_INFO`` for the generated corpus (mmidx's build reads the same mapping)."""
    return {"t2i_pretrain": {"t2i": {"data_dir": str(raw / "t2i")}},
            "unified_edit": {"seedxedit_multi": {
                "data_dir": str(raw / "editing" / "seedxedit_multi"),
                "parquet_info_path": str(raw / "editing" / "parquet_info" / "seedxedit_multi.json")}},
            "vlm_sft": {"llava_ov": {"data_dir": str(raw / "vlm" / "images"),
                                     "jsonl_path": str(raw / "vlm" / "sft.jsonl")}}}


def add_bagel_site(bagel_site: str | None) -> None:
    """Make the packages of ``bagel_site`` importable, torchvision's Python parts included beside a CPU torch."""
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    if bagel_site and bagel_site not in sys.path:
        sys.path.append(bagel_site)


def import_bagel(bagel_src: str, bagel_site: str | None) -> None:
    """Make BAGEL's ``data`` package importable (with :func:`add_bagel_site`), and silence the prints it makes per
    skipped sample and per pack."""
    add_bagel_site(bagel_site)
    if bagel_src not in sys.path:
        sys.path.insert(0, bagel_src)
    import data.dataset_base  # noqa: F401  BAGEL's own, unmodified: imports every module of its package

    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("data.") and hasattr(module, "__dict__"):
            module.print = lambda *args, **kwargs: None


def bagel_commit(bagel_src: str, given: str | None = None) -> str:
    """The BAGEL commit compared with: ``given``, else the checkout's own ``.git``, else "unknown"."""
    if given:
        return given
    try:
        return subprocess.run(["git", "-C", bagel_src, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (no .git in --bagel-src; pass --bagel-commit)"


class BagelTokenizer:
    """The part of Qwen2Tokenizer BAGEL's data code calls: ``encode`` (no special tokens)."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


def packed_dataset(raw: Path, groups: list[str], use_flex: bool, budgets: dict[str, int] | None = None, *,
                   rank: int = 0, world_size: int = 1, num_workers: int = 1) -> Any:
    """BAGEL's ``PackedDataset`` over the corpus's ``groups``, with bench_pack's dropout and geometry and its
    budgets (or ``budgets``; call :func:`import_bagel` first), for ``rank`` of ``world_size`` read by
    ``num_workers`` loader workers (BAGEL shares its files out among them)."""
    import data.dataset_base as dataset_base
    import data.dataset_info as dataset_info_module

    tokenizer = BagelTokenizer(raw / "tokenizer" / "bpe.json")
    ids = tokenizer.tokenizer.token_to_id
    special = {"bos_token_id": ids("<|im_start|>"), "eos_token_id": ids("<|im_end|>"),
               "start_of_image": ids("<|vision_start|>"), "end_of_image": ids("<|vision_end|>")}
    dataset_info_module.DATASET_INFO.clear()
    dataset_info_module.DATASET_INFO.update(dataset_info(raw))
    meta = json.loads((raw / "meta.json").read_text())
    used = {"t2i_pretrain": [meta["t2i_files"]], "unified_edit": [meta["edit_files"]], "vlm_sft": [meta["vlm_lines"]]}
    grouped = {}
    for group in groups:
        spec = {key: (dict(value) if isinstance(value, dict) else value) for key, value in BAGEL_GROUPS[group].items()}
        spec["num_used_data"] = used[group]
        if group == "vlm_sft":
            spec.update(shuffle_lines=True, shuffle_seed=0)
        grouped[group] = spec
    data_config = dataset_base.DataConfig(grouped_datasets=grouped, **GEOMETRY)
    data_config.text_cond_dropout_prob = DROPOUT["text"]
    data_config.vit_cond_dropout_prob, data_config.vae_cond_dropout_prob = DROPOUT["vit"], DROPOUT["vae"]
    packed = dataset_base.PackedDataset(data_config, tokenizer=tokenizer, special_tokens=special, local_rank=rank,
                                        world_size=world_size, num_workers=num_workers, interpolate_pos=False,
                                        use_flex=use_flex, data_status=None, **(budgets or BUDGETS))
    packed.set_epoch(0)
    return packed


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Write the generated corpus and build its mmidx datasets (what "
                                                 "bench_pack.py and tools/check_bagel.py read) under --workdir.")
    parser.add_argument("--workdir", default="/tmp/mmidx-bench-pack")
    parser.add_argument("--image-size", type=int, default=512)
    args = parser.parse_args()
    raw, datasets = prepare(Path(args.workdir), args.image_size)
    print(f"raw files: {raw}\nmmidx datasets: {datasets}")


if __name__ == "__main__":
    main()
