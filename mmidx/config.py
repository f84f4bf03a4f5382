"""Typed, validated configuration of a training mix: dataset groups, packing budgets, randomness.

The YAML form (``data.yaml``, written by ``mmidx build --config`` and read by ``mmidx index`` and
the loader) mirrors BAGEL's ``data/configs/*.yaml`` with dataset names replaced by mmidx prefixes::

    groups:
      t2i_pretrain:
        datasets: [t2i_pretrain/t2i]        # prefixes, relative to the YAML file's folder
        weight: 1.0
        is_mandatory: true
        image_transform_args: {image_stride: 16, max_image_size: 1024, min_image_size: 512}
        vit_image_transform_args: {image_stride: 14, max_image_size: 518, min_image_size: 224}
    packing: {expected_num_tokens: 32768, max_num_tokens: 36864}     # optional, BAGEL's defaults
    dropout: {text: 0.1, vit: 0.3, vae: 0.3}                          # optional

BAGEL's ``num_used_data`` (one count per dataset), ``shuffle_lines`` and ``shuffle_seed`` choose which
samples a group uses, with BAGEL's meaning (:mod:`mmidx.index.subsets`); ``resume_data_status`` is accepted
and ignored (a note says why); ``encodings: {vae: NAME, vit: NAME, text: NAME}`` names the precached
encodings (``mmidx precache``) whose packs carry ``padded_latent``, ``packed_vit_embeddings`` (a frozen
ViT's outputs) or text embeddings; any other key is refused.

VAE elements use ``image_transform_args``; ViT elements use ``vit_image_transform_args`` when given
and ``image_transform_args`` otherwise — as BAGEL's ``vlm_sft`` group does.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mmidx.images.transform import ImageTransform
from mmidx.io.storage import is_remote, read_object


@dataclass(frozen=True)
class GroupConfig:
    """One group of datasets mixed by weight (BAGEL: one entry of ``grouped_datasets``)."""

    name: str
    datasets: tuple[str, ...]
    weight: float = 1.0
    is_mandatory: bool = False
    image_transform: ImageTransform | None = None
    vit_image_transform: ImageTransform | None = None
    num_used_data: tuple[int, ...] | None = None  # BAGEL's: per dataset, lines (vlm) or parquet files used
    shuffle_lines: bool = False  # BAGEL's (vlm): which lines num_used_data keeps, shuffled by shuffle_seed
    shuffle_seed: int = 0
    encodings: tuple[tuple[str, str], ...] = ()  # precached encodings used: (use, name), e.g. ("vae", "flux")

    def __post_init__(self) -> None:
        object.__setattr__(self, "datasets", tuple(os.fspath(d) for d in self.datasets))
        object.__setattr__(self, "encodings", tuple(sorted(dict(self.encodings).items())))
        if not self.datasets:
            raise ValueError(f"group {self.name!r} lists no datasets")
        if not self.weight > 0:
            raise ValueError(f"group {self.name!r}: weight must be positive, got {self.weight}")
        if self.num_used_data is not None:
            object.__setattr__(self, "num_used_data", tuple(int(n) for n in self.num_used_data))
            if len(self.num_used_data) != len(self.datasets) or min(self.num_used_data) < 1:
                raise ValueError(f"group {self.name!r}: num_used_data needs one positive count per dataset "
                                 f"({len(self.datasets)}), got {list(self.num_used_data)}")

    @property
    def vae_transform(self) -> ImageTransform | None:
        """The transform of this group's vae_image elements."""
        return self.image_transform

    @property
    def vit_transform(self) -> ImageTransform | None:
        """The transform of vit_image elements: the ViT arguments if given, else the group's own."""
        return self.vit_image_transform or self.image_transform


@dataclass(frozen=True)
class PackingConfig:
    """Token budgets of a pack (BAGEL's ``PackedDataset`` arguments, same defaults)."""

    expected_num_tokens: int = 32768
    max_num_tokens: int = 36864
    max_num_tokens_per_sample: int = 16384
    prefer_buffer_before: int = 16384
    max_buffer_size: int = 50

    def __post_init__(self) -> None:
        if not 0 < self.expected_num_tokens <= self.max_num_tokens:
            raise ValueError(f"need 0 < expected_num_tokens ({self.expected_num_tokens}) <= max_num_tokens "
                             f"({self.max_num_tokens})")
        if not 0 < self.max_num_tokens_per_sample <= self.max_num_tokens:
            raise ValueError(f"need 0 < max_num_tokens_per_sample ({self.max_num_tokens_per_sample}) <= "
                             f"max_num_tokens ({self.max_num_tokens}): a sample must fit a pack")
        if self.max_buffer_size < 0 or self.prefer_buffer_before < 0:
            raise ValueError("max_buffer_size and prefer_buffer_before cannot be negative")


@dataclass(frozen=True)
class DropoutConfig:
    """CFG dropout probabilities of elements with enable_cfg (BAGEL's training defaults)."""

    text: float = 0.1
    vit: float = 0.3
    vae: float = 0.3

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"dropout.{name} must be a probability, got {value}")


@dataclass(frozen=True)
class ModelGeometry:
    """Patch sizes and position-id grids of the model the batches feed (BAGEL's defaults)."""

    vit_patch_size: int = 14
    max_num_patch_per_side: int = 70
    vae_image_downsample: int = 16
    max_latent_size: int = 32
    interpolate_pos: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides which samples make which packs, and how a pack becomes a batch."""

    groups: tuple[GroupConfig, ...]
    packing: PackingConfig = field(default_factory=PackingConfig)
    dropout: DropoutConfig = field(default_factory=DropoutConfig)
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a data config needs at least one group")
        names = [group.name for group in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: str | os.PathLike = ".") -> DataConfig:
        """Build from the YAML schema in this module's docstring; relative prefixes resolve against base_dir."""
        unknown = set(data) - {"groups", "packing", "dropout", "geometry", "seed"}
        if unknown:
            raise ValueError(f"unknown data config keys {sorted(unknown)}")
        groups = []
        for name, spec in dict(data.get("groups") or {}).items():
            spec = dict(spec)
            _check_group_keys(name, spec, GROUP_KEYS)
            datasets = [d if os.path.isabs(d) or "://" in d or os.fspath(base_dir) in ("", ".")  # URIs as they are,
                        else os.path.join(base_dir, d) for d in spec.get("datasets", [])]  # no "./" prepended
            used = spec.get("num_used_data")
            groups.append(GroupConfig(
                name=name, datasets=tuple(datasets), weight=float(spec.get("weight", 1.0)),
                is_mandatory=bool(spec.get("is_mandatory", False)),
                image_transform=_transform(spec.get("image_transform_args")),
                vit_image_transform=_transform(spec.get("vit_image_transform_args")),
                num_used_data=None if used is None else tuple(used),
                shuffle_lines=bool(spec.get("shuffle_lines", False)), shuffle_seed=int(spec.get("shuffle_seed", 0)),
                encodings=tuple(dict(spec.get("encodings") or {}).items())))
        return cls(groups=tuple(groups), packing=PackingConfig(**data.get("packing", {})),
                   dropout=DropoutConfig(**data.get("dropout", {})),
                   geometry=ModelGeometry(**data.get("geometry", {})), seed=int(data.get("seed", 0)))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> DataConfig:
        """Read a ``data.yaml``: a path, or a URI in object storage (relative prefixes then resolve beside it)."""
        if is_remote(path):
            base = os.fspath(path).partition("?")[0].rsplit("/", 1)[0]
            return cls.from_dict(yaml.safe_load(read_object(os.fspath(path)).decode("utf-8")) or {}, base_dir=base)
        with open(path, encoding="utf-8") as stream:
            return cls.from_dict(yaml.safe_load(stream) or {}, base_dir=Path(path).resolve().parent)

    def describe(self) -> dict[str, Any]:
        """Plain-data description (for hashing and for the index cache's description file)."""
        return json.loads(json.dumps(asdict(self), default=str))

    def fingerprint(self) -> str:
        """sha256 of the description: part of the index cache key."""
        return hashlib.sha256(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()


# BAGEL's transform arguments for each source type (data/configs/example.yaml), used when datasets are
# named directly instead of through a data.yaml.
VAE_ARGS = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
EDIT_VIT_ARGS = {"image_stride": 14, "max_image_size": 518, "min_image_size": 224}
VLM_ARGS = {"image_stride": 14, "max_image_size": 980, "min_image_size": 378, "max_pixels": 2_007_040}
SOURCE_TRANSFORMS: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {
    "t2i": (VAE_ARGS, None), "wds": (VAE_ARGS, None), "edit": (VAE_ARGS, EDIT_VIT_ARGS),
    "prompts": (VAE_ARGS, EDIT_VIT_ARGS), "vlm": (VLM_ARGS, None), "chat": (None, None), "text": (None, None),
}


def config_for(paths: list[str], **overrides: Any) -> DataConfig:
    """A data config from a ``data.yaml`` path, or from dataset prefixes (one equally weighted group each,
    with BAGEL's transforms for the source type recorded in each dataset's metadata)."""
    if len(paths) == 1 and paths[0].endswith((".yaml", ".yml")):
        config = DataConfig.from_yaml(paths[0])
        return DataConfig(**{**{f: getattr(config, f) for f in ("groups", "packing", "dropout", "geometry", "seed")},
                             **overrides})
    from mmidx.read.dataset import MMIDXDataset

    groups = []
    for number, prefix in enumerate(paths):
        dataset = MMIDXDataset(prefix)
        source = ((dataset.metadata or {}).get("build") or {}).get("source") or dataset.kind
        vae, vit = SOURCE_TRANSFORMS.get(source, (VAE_ARGS, EDIT_VIT_ARGS))
        groups.append(GroupConfig(name=f"{number}:{source}", datasets=(prefix,), image_transform=_transform(vae),
                                  vit_image_transform=_transform(vit)))
    return DataConfig(groups=tuple(groups), **overrides)


# Group keys of a data.yaml; BAGEL's data/configs/*.yaml groups have the same ones with dataset_names instead
# of datasets. Keys that mean nothing once datasets are built are accepted, with the note saying why.
GROUP_KEYS = ("datasets", "weight", "is_mandatory", "image_transform_args", "vit_image_transform_args",
              "num_used_data", "shuffle_lines", "shuffle_seed", "encodings")
BAGEL_GROUP_KEYS = ("dataset_names", *GROUP_KEYS[1:], "frame_sampler_args")
IGNORED_GROUP_KEYS = {
    "resume_data_status": "mmidx resumes from the loader's packs consumed (saved in data_status['mmidx']), "
                          "never from per-dataset rows",
}


def _check_group_keys(name: str, spec: Mapping[str, Any], known: tuple[str, ...]) -> None:
    """Refuse unknown keys of a group, naming them; note the ignored ones."""
    for key in sorted(set(spec) & set(IGNORED_GROUP_KEYS)):
        warnings.warn(f"group {name!r}: {key} is ignored: {IGNORED_GROUP_KEYS[key]}", stacklevel=3)
    unknown = sorted(set(spec) - set(known) - set(IGNORED_GROUP_KEYS))
    if unknown:
        raise ValueError(f"group {name!r}: unknown keys {unknown}; the known ones are {', '.join(known)}")


def data_yaml_group(name: str, spec: Mapping[str, Any], datasets: list[str]) -> dict[str, Any]:
    """The data.yaml entry of one group of a BAGEL data config, whose dataset names were built as
    ``datasets``: BAGEL's keys carried over, unknown keys refused (``frame_sampler_args`` is used
    by the build, not here)."""
    _check_group_keys(name, spec, BAGEL_GROUP_KEYS)
    entry: dict[str, Any] = {"datasets": list(datasets), "weight": float(spec.get("weight", 1.0)),
                             "is_mandatory": bool(spec.get("is_mandatory", False)),
                             "image_transform_args": dict(spec.get("image_transform_args", {}))}
    entry.update({key: spec[key] for key in GROUP_KEYS[4:] if key in spec})
    return entry


def _transform(args: Mapping[str, Any] | None) -> ImageTransform | None:
    return None if args is None else ImageTransform.from_args(args)
