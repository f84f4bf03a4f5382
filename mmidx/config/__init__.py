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
    # packing: {policy: tight, window: 128, cost_slack: 0.065}   # fill toward max_num_tokens, packs that cost alike
    dropout: {text: 0.1, vit: 0.3, vae: 0.3}                          # optional
    geometry: {max_latent_size: 64}         # optional, BAGEL's; 1,024-px VAE images need a 64-wide latent grid
    seed: 0                                                           # optional
    schedule:                                  # optional: phases of the mixture over the run
      - until: {packs: 1000}                   # or {tokens: 2000000000}; counted from the run's start
        weights: {t2i_pretrain: 1.0, vlm_sft: 1.0}
      - weights: {t2i_pretrain: 1.0, vlm_sft: 3.0}                     # the last phase is open-ended
    allow_duplicates: false                    # optional: allow a dataset in two groups or twice in one

Every key, with its type, default and meaning: docs/reference/data-config.md; each is checked as the file is
read (an unknown key or a wrong type is one line naming the file and the key).

A ``schedule`` replaces the groups' ``weight`` keys: each phase weighs the groups anew (a group absent from
a phase, or at weight 0, takes no samples in it) and ends once the run has closed ``packs`` packs or packed
``tokens`` tokens (:mod:`mmidx.index.schedule`). No schedule, or one phase, is a single blend as before.

BAGEL's ``num_used_data`` (one count per dataset), ``shuffle_lines`` and ``shuffle_seed`` choose which
samples a group uses, with BAGEL's meaning (:mod:`mmidx.index.subsets`); ``resume_data_status`` is accepted
and ignored (a note says why); ``encodings: {vae: NAME, vit: NAME, text: NAME}`` names the precached
encodings (``mmidx precache``) whose packs carry ``padded_latent``, ``packed_vit_embeddings`` (a frozen
ViT's outputs) or text embeddings; any other key is refused.

VAE elements use ``image_transform_args``; ViT elements use ``vit_image_transform_args`` when given
and ``image_transform_args`` otherwise — as BAGEL's ``vlm_sft`` group does.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from mmidx.config.schedule import PhaseConfig, check_schedule, parse_schedule
from mmidx.config.schema import (
    GROUP_KEY_TYPES,
    TOP_KEYS,
    TRANSFORM_KEY_TYPES,
    check_type,
    checked_mapping,
    checked_section,
    kind_of,
)
from mmidx.images.transform import ImageTransform
from mmidx.io.storage import is_remote, join, local_path, parent, read_object, without_query


def is_data_yaml(location: str | os.PathLike) -> bool:
    """Whether ``location`` names a YAML file (``data.yaml``, or a URI of one with query options:
    ``s3://b/ds/data.yaml?endpoint_override=...``) rather than a dataset prefix."""
    return without_query(os.fspath(location)).endswith((".yaml", ".yml"))


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


# The tight policy's default cost cap: a pack costs at most 6.5% more than a full pack of the stream's recent
# average sample (measured on the scale, text and video mixes: docs/guide/packing.md).
DEFAULT_COST_SLACK = 0.065


@dataclass(frozen=True)
class PackingConfig:
    """Token budgets of a pack (BAGEL's ``PackedDataset`` arguments, same defaults)."""

    expected_num_tokens: int = 32768
    max_num_tokens: int = 36864
    max_num_tokens_per_sample: int = 16384
    prefer_buffer_before: int = 16384
    max_buffer_size: int = 50
    policy: str = "bagel"  # or "tight": fill toward max_num_tokens (docs/guide/packing.md)
    window: int = 128  # the tight policy's window of stream items
    cost_slack: float | None = DEFAULT_COST_SLACK  # the tight policy's cost cap (None: tokens only)

    def __post_init__(self) -> None:
        if self.policy not in ("bagel", "tight"):
            raise ValueError(f"packing.policy must be 'bagel' or 'tight', got {self.policy!r}")
        if self.window < 1:
            raise ValueError(f"packing.window must be at least 1 item, got {self.window}")
        if self.cost_slack is not None and not 0 <= self.cost_slack <= 1:
            raise ValueError(f"packing.cost_slack must be a fraction in [0, 1] (0.065: a pack may cost 6.5% more "
                             f"than a full pack of the stream's average sample) or null, got {self.cost_slack}")
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

    def __post_init__(self) -> None:
        for name in ("vit_patch_size", "max_num_patch_per_side", "vae_image_downsample", "max_latent_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"geometry.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.interpolate_pos, bool):
            raise ValueError(f"geometry.interpolate_pos must be true or false, got {self.interpolate_pos!r}")

    @classmethod
    def covering(cls, groups: tuple[GroupConfig, ...], **given: Any) -> ModelGeometry:
        """The geometry whose position grids hold every image the groups' transforms can output: BAGEL's
        defaults, raised where a transform's ``max_image_size`` needs it (BAGEL's 1024-px VAE transform:
        ``max_latent_size`` 64, as BAGEL's own fine-tuning sets it). Fields in ``given`` are kept as given."""
        geometry = cls(**given)
        needs = {"max_latent_size": (geometry.vae_image_downsample, [g.vae_transform for g in groups]),
                 "max_num_patch_per_side": (geometry.vit_patch_size, [g.vit_transform for g in groups])}
        raised = {}
        for name, (patch, transforms) in needs.items():
            sides = [t.max_image_size // patch for t in transforms if t is not None]
            if name not in given and sides and max(sides) > getattr(geometry, name):
                raised[name] = max(sides)
        return replace(geometry, **raised)


@dataclass(frozen=True)
class DataConfig:
    """Everything that decides which samples make which packs, and how a pack becomes a batch."""

    groups: tuple[GroupConfig, ...]
    packing: PackingConfig = field(default_factory=PackingConfig)
    dropout: DropoutConfig = field(default_factory=DropoutConfig)
    geometry: ModelGeometry = field(default_factory=ModelGeometry)
    seed: int = 0
    schedule: tuple[PhaseConfig, ...] = ()  # phases of the mixture; () = one blend by the groups' weights
    allow_duplicates: bool = False  # a dataset in two groups, or twice in one, is refused unless set

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a data config needs at least one group")
        names = [group.name for group in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")
        object.__setattr__(self, "schedule", tuple(self.schedule))
        check_schedule(self.schedule, names)

    def phase_weights(self) -> list[tuple[list[float], int | None, int | None]]:
        """(weights per group in config order, until packs, until tokens) of every phase; one open phase
        of the groups' weights without a schedule."""
        if not self.schedule:
            return [([g.weight for g in self.groups], None, None)]
        return [([p.weight_of(g.name) for g in self.groups], p.until_packs, p.until_tokens) for p in self.schedule]

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], base_dir: str | os.PathLike = ".") -> DataConfig:
        """Build from the YAML schema in this module's docstring (every key: docs/reference/data-config.md);
        relative prefixes resolve against base_dir. A wrong key or type is a one-line ``ValueError`` naming it."""
        data = checked_mapping("the data config", data, TOP_KEYS)
        groups = []
        if not isinstance(data.get("groups"), Mapping) or not data["groups"]:
            raise ValueError("the data config needs groups: a mapping of group name → {datasets: [...], ...}")
        for name, spec in data["groups"].items():
            if not isinstance(spec, Mapping):
                raise ValueError(f"group {name!r} must be a mapping (datasets:, weight:, ...), got {kind_of(spec)}")
            spec = dict(spec)
            _check_group_keys(name, spec, GROUP_KEYS)
            for key, want in GROUP_KEY_TYPES.items():
                if key in spec:
                    check_type(f"groups.{name}.{key}", spec[key], want)
            datasets = [d if os.path.isabs(d) or "://" in d or os.fspath(base_dir) in ("", ".")  # URIs as they are,
                        else join(os.fspath(base_dir), d) for d in spec.get("datasets", [])]  # no "./" prepended
            used = spec.get("num_used_data")
            groups.append(GroupConfig(
                name=name, datasets=tuple(datasets), weight=float(spec.get("weight", 1.0)),
                is_mandatory=bool(spec.get("is_mandatory", False)),
                image_transform=_transform(spec.get("image_transform_args"), f"groups.{name}.image_transform_args"),
                vit_image_transform=_transform(spec.get("vit_image_transform_args"),
                                               f"groups.{name}.vit_image_transform_args"),
                num_used_data=None if used is None else tuple(used),
                shuffle_lines=bool(spec.get("shuffle_lines", False)), shuffle_seed=int(spec.get("shuffle_seed", 0)),
                encodings=tuple(dict(spec.get("encodings") or {}).items())))
        check_type("seed", data.get("seed", 0), int)
        check_type("allow_duplicates", data.get("allow_duplicates", False), bool)
        return cls(groups=tuple(groups), packing=checked_section("packing", PackingConfig, data.get("packing")),
                   dropout=checked_section("dropout", DropoutConfig, data.get("dropout")),
                   geometry=checked_section("geometry", ModelGeometry, data.get("geometry")),
                   seed=int(data.get("seed", 0)), schedule=parse_schedule(data.get("schedule")),
                   allow_duplicates=bool(data.get("allow_duplicates", False)))

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> DataConfig:
        """Read a ``data.yaml``: a path (or ``file://`` URI), or a URI in object storage; relative prefixes then
        resolve beside it, with the URI's query options (``?endpoint_override=...``): read from the same store."""
        path = local_path(os.fspath(path))
        if is_remote(path):
            return cls.from_dict(yaml.safe_load(read_object(path).decode("utf-8")) or {}, base_dir=parent(path))
        with open(path, encoding="utf-8") as stream:
            data = yaml.safe_load(stream) or {}
        try:
            return cls.from_dict(data, base_dir=Path(path).resolve().parent)
        except ValueError as error:  # which file, then which key
            raise ValueError(f"{os.fspath(path)}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The YAML schema of this config, every prefix absolute: ``from_dict(to_dict())`` equals it (the
        mixture history records configs this way, so an edited data.yaml cannot change a recorded one)."""
        groups = {}
        for g in self.groups:
            spec: dict[str, Any] = {"datasets": list(g.datasets), "weight": g.weight, "is_mandatory": g.is_mandatory,
                                    "shuffle_lines": g.shuffle_lines, "shuffle_seed": g.shuffle_seed,
                                    "encodings": dict(g.encodings)}
            for key, transform in (("image_transform_args", g.image_transform),
                                   ("vit_image_transform_args", g.vit_image_transform)):
                if transform is not None:
                    spec[key] = asdict(transform)
            if g.num_used_data is not None:
                spec["num_used_data"] = list(g.num_used_data)
            groups[g.name] = spec
        schedule = [{"weights": dict(p.weights),
                     **({"until": {"packs": p.until_packs}} if p.until_packs is not None else {}),
                     **({"until": {"tokens": p.until_tokens}} if p.until_tokens is not None else {})}
                    for p in self.schedule]
        return {"groups": groups, "packing": asdict(self.packing), "dropout": asdict(self.dropout),
                "geometry": asdict(self.geometry), "seed": self.seed, "allow_duplicates": self.allow_duplicates,
                **({"schedule": schedule} if schedule else {})}

    def describe(self) -> dict[str, Any]:
        """Plain-data description (for hashing and for the index cache's description file)."""
        described = json.loads(json.dumps(asdict(self), default=str))
        for key in ("schedule", "allow_duplicates"):  # absent when unused: earlier cache keys stay valid
            if not described[key]:
                del described[key]
        if self.packing.policy == "bagel":  # bagel ignores the window and cost: today's cache keys stay valid
            del described["packing"]["policy"], described["packing"]["window"], described["packing"]["cost_slack"]
        return described


# BAGEL's transform arguments for each source type (data/configs/example.yaml), used when datasets are
# named directly instead of through a data.yaml.
VAE_ARGS = {"image_stride": 16, "max_image_size": 1024, "min_image_size": 512}
EDIT_VIT_ARGS = {"image_stride": 14, "max_image_size": 518, "min_image_size": 224}
VLM_ARGS = {"image_stride": 14, "max_image_size": 980, "min_image_size": 378, "max_pixels": 2_007_040}
SOURCE_TRANSFORMS: dict[str, tuple[dict[str, Any] | None, dict[str, Any] | None]] = {
    "t2i": (VAE_ARGS, None), "wds": (VAE_ARGS, None), "edit": (VAE_ARGS, EDIT_VIT_ARGS),
    "prompts": (VAE_ARGS, EDIT_VIT_ARGS), "vlm": (VLM_ARGS, None), "chat": (None, None), "text": (None, None),
}


def config_for(paths: list[str], geometry_args: Mapping[str, Any] | None = None, **overrides: Any) -> DataConfig:
    """A data config from a ``data.yaml`` path, or from dataset prefixes (one equally weighted group each,
    with BAGEL's transforms for the source type recorded in each dataset's metadata, and a geometry that
    holds every image those transforms output: :meth:`ModelGeometry.covering`).

    ``geometry_args`` replaces fields of the geometry (the YAML's, or the covering one); ``overrides``
    replaces whole fields of the config (``seed``, ``geometry``...)."""
    given = dict(geometry_args or {})
    if len(paths) == 1 and is_data_yaml(paths[0]):
        config = DataConfig.from_yaml(paths[0])
        parts = {f: getattr(config, f) for f in ("groups", "packing", "dropout", "geometry", "seed", "schedule",
                                                 "allow_duplicates")}
        parts["geometry"] = replace(config.geometry, **given)
        return DataConfig(**{**parts, **overrides})
    from mmidx.read.dataset import MMIDXDataset

    groups = []
    for number, prefix in enumerate(paths):
        if is_data_yaml(prefix):
            raise ValueError(f"{prefix}: a data YAML is given alone; name dataset prefixes, or one data.yaml")
        dataset = MMIDXDataset(prefix)
        source = ((dataset.metadata or {}).get("build") or {}).get("source") or dataset.kind
        vae, vit = SOURCE_TRANSFORMS.get(source, (VAE_ARGS, EDIT_VIT_ARGS))
        groups.append(GroupConfig(name=f"{number}:{source}", datasets=(prefix,), image_transform=_transform(vae),
                                  vit_image_transform=_transform(vit)))
    # the transforms are ours here, so is the geometry: one that holds what they output
    overrides.setdefault("geometry", ModelGeometry.covering(tuple(groups), **given))
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


def _transform(args: Mapping[str, Any] | None, where: str = "image_transform_args") -> ImageTransform | None:
    if args is None:
        return None
    known = {f.name: f.type for f in fields(ImageTransform)}
    for key, value in checked_mapping(where, args, tuple(known)).items():
        check_type(f"{where}.{key}", value, TRANSFORM_KEY_TYPES[key])
    return ImageTransform.from_args(args)


