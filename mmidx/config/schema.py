"""The data.yaml schema, checked key by key as a file is read: each wrong key or type is one line naming it.

docs/reference/data-config.md documents every key; a test compares the page with what is accepted here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

# The data.yaml schema, checked key by key (docs/reference/data-config.md documents each; a test compares).
TOP_KEYS = ("groups", "packing", "dropout", "geometry", "seed", "schedule", "allow_duplicates")
GROUP_KEY_TYPES: dict[str, Any] = {
    "datasets": list, "weight": float, "is_mandatory": bool, "image_transform_args": dict,
    "vit_image_transform_args": dict, "num_used_data": list, "shuffle_lines": bool, "shuffle_seed": int,
    "encodings": dict}
TRANSFORM_KEY_TYPES: dict[str, Any] = {"max_image_size": int, "min_image_size": int, "image_stride": int,
                                       "max_pixels": int, "image_mean": list, "image_std": list}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", list: "a list", dict: "a mapping",
               str: "a string"}


def kind_of(value: Any) -> str:
    """How a YAML reader would name ``value``'s type."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "a mapping", type(None): "nothing"}.get(type(value), type(value).__name__) + f" ({value!r})"


def check_type(where: str, value: Any, want: Any) -> None:
    """Refuse ``value`` unless YAML wrote it as ``want`` (an int is a float; a bool is not a number)."""
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
          bool: lambda v: isinstance(v, bool), list: lambda v: isinstance(v, list | tuple),
          dict: lambda v: isinstance(v, Mapping), str: lambda v: isinstance(v, str)}[want](value)
    if not ok:
        raise ValueError(f"{where} must be {_TYPE_WORDS[want]}, got {kind_of(value)}")


def checked_mapping(where: str, values: Any, known: tuple[str, ...]) -> dict[str, Any]:
    """``values`` as a dict, refusing a non-mapping or unknown keys with the known ones named."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{where} must be a mapping of {', '.join(known)}; got {kind_of(values)}")
    unknown = sorted(set(values) - set(known), key=str)
    if unknown:
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(str, unknown))}; "
                         f"the known ones are {', '.join(known)}")
    return dict(values)


def checked_section(name: str, cls: Any, values: Any) -> Any:
    """One of the data.yaml's packing / dropout / geometry mappings as ``cls``, every key and type checked
    (a key typed ``X | None`` also takes YAML's null)."""
    types = {f.name: f.type for f in fields(cls)}
    values = checked_mapping(name, values, tuple(types))
    for key, value in values.items():
        kind, optional = types[key].removesuffix(" | None"), types[key].endswith(" | None")
        if not (optional and value is None):
            check_type(f"{name}.{key}", value, {"int": int, "float": float, "bool": bool, "str": str}[kind])
    return cls(**values)
