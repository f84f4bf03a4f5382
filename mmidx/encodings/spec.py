"""``precache.yaml``: the seed's encoder config (``precache_encodings``), read into :class:`Job` objects.

A list ``encodings:`` whose entries have ``modality`` (image|text), ``key`` (the stream's name),
``precision`` (16|32|bf16|fp16|fp32; 16 is fp16), ``store_pad_tokens`` (text only), ``input`` (text
only: ``text``, the default, a list of the texts' strings, or ``tokens``, the dataset's token ids) and
``encoder_config`` with ``cls`` (``pkg.module.Class`` or ``pkg.module:factory``) plus the keyword
arguments passed to it. mmidx's own options may be given per entry: ``transform`` (vae|vit, images),
``store`` (moments|mean|sample), ``batch_size`` and ``weights_version``. Unknown keys are refused,
listing the known ones.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from mmidx.encodings.encode import Job
from mmidx.errors import MMIDXError

PRECISIONS = {16: "fp16", 32: "fp32", "16": "fp16", "32": "fp32", "bf16": "bf16", "fp16": "fp16", "fp32": "fp32"}
ENTRY_KEYS = ("modality", "key", "precision", "store_pad_tokens", "input", "encoder_config", "transform", "store",
              "batch_size", "weights_version")
TOP_KEYS = ("encodings",)


class PrecacheConfigError(MMIDXError, ValueError):
    """A precache.yaml that cannot be read as the seed's encoder config: the message names the file and key."""


def read_precache_config(path: str | os.PathLike, batch_size: int | None = None) -> list[Job]:
    """The jobs of the precache config at ``path`` (``batch_size``, when given, for entries that set none)."""
    try:
        with open(path, encoding="utf-8") as stream:
            spec = yaml.safe_load(stream)
    except OSError as error:
        raise PrecacheConfigError(f"{path}: cannot read it ({error.strerror})") from error
    except yaml.YAMLError as error:
        raise PrecacheConfigError(f"{path}: not YAML ({str(error).splitlines()[0]})") from error
    return jobs_of(spec, str(path), batch_size)


def jobs_of(spec: Any, where: str, batch_size: int | None = None) -> list[Job]:
    """The jobs of a parsed precache config (``where`` names it in errors)."""
    if not isinstance(spec, dict):
        raise PrecacheConfigError(f"{where}: a precache config is a mapping with a list 'encodings:'")
    unknown = sorted(set(spec) - set(TOP_KEYS))
    if unknown:
        raise PrecacheConfigError(f"{where}: unknown keys {unknown}; the known ones are {list(TOP_KEYS)}")
    entries = spec.get("encodings")
    if not isinstance(entries, list) or not entries:
        raise PrecacheConfigError(f"{where}: 'encodings:' must be a non-empty list of entries")
    jobs = [_job(entry, f"{where}: encodings[{number}]", batch_size) for number, entry in enumerate(entries)]
    names = [job.name for job in jobs]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise PrecacheConfigError(f"{where}: keys {twice} appear twice; each encoding needs its own key")
    return jobs


def _job(entry: Any, where: str, batch_size: int | None) -> Job:
    if not isinstance(entry, dict):
        raise PrecacheConfigError(f"{where}: an entry is a mapping of {list(ENTRY_KEYS)}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise PrecacheConfigError(f"{where}: unknown keys {unknown}; the known ones are {list(ENTRY_KEYS)}")
    missing = [key for key in ("modality", "key", "encoder_config") if key not in entry]
    if missing:
        raise PrecacheConfigError(f"{where}: {missing} missing")
    modality = entry["modality"]
    config = entry["encoder_config"]
    if not isinstance(config, dict) or not isinstance(config.get("cls"), str):
        raise PrecacheConfigError(f"{where}: encoder_config must be a mapping with cls: pkg.module.Class (or "
                                  "pkg.module:factory) and the keyword arguments passed to it")
    if modality == "image" and ("store_pad_tokens" in entry or "input" in entry):
        raise PrecacheConfigError(f"{where}: store_pad_tokens and input are for text encodings")
    if modality == "text" and "transform" in entry:
        raise PrecacheConfigError(f"{where}: transform is for image encodings")
    precision = entry.get("precision", "bf16")
    if precision not in PRECISIONS:
        raise PrecacheConfigError(f"{where}: precision {precision!r} is not one of 16, 32, bf16, fp16, fp32")
    store_pad_tokens = entry.get("store_pad_tokens", True)
    if not isinstance(store_pad_tokens, bool):
        raise PrecacheConfigError(f"{where}: store_pad_tokens is true or false, not {store_pad_tokens!r}")
    try:
        return Job(str(entry["key"]), config["cls"], modality=modality, transform=entry.get("transform", "vae"),
                   store=entry.get("store", "moments"), dtype=PRECISIONS[precision],
                   batch_size=entry.get("batch_size", batch_size or 16),
                   weights_version=entry.get("weights_version"), input=entry.get("input", "text"),
                   store_pad_tokens=store_pad_tokens,
                   encoder_kwargs={key: value for key, value in config.items() if key != "cls"})
    except (ValueError, TypeError) as error:
        raise PrecacheConfigError(f"{where}: {error}") from None
