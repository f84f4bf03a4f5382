"""What a viewer serves: the datasets it was given, by name, and what it computes of them once.

A URL names a dataset by a short name chosen here (its prefix's last component, made unique), never
by a path: whatever a request says, it can only reach the datasets of this catalog, through their
readers. Everything computed from whole index arrays (an overview, the pack index, per-pack token
counts) or slow to load (a tokenizer) is computed once, under a lock, and kept: the datasets are
read-only and do not change while they are served.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import numpy as np

from mmidx.config import DataConfig, is_data_yaml
from mmidx.errors import MMIDXError
from mmidx.format import FormatError
from mmidx.read.dataset import MMIDXDataset
from mmidx.toolkit.sample import dataset_tokenizer

T = TypeVar("T")


class PacksUnavailable(MMIDXError):
    """The catalog has no packs to show: why, in one line (no data YAML, or its index failed to build)."""


@dataclass
class ViewedDataset:
    """One served dataset: its URL name, where it is, the group of the data YAML that named it."""

    name: str
    prefix: str
    group: str | None
    dataset: MMIDXDataset


class _Once:
    """Values computed at most once each, by key, concurrent askers of one key waiting for the first."""

    def __init__(self) -> None:
        self._values: dict[Any, Any] = {}
        self._locks: dict[Any, threading.Lock] = {}
        self._guard = threading.Lock()

    def peek(self, key: Any, default: Any = None) -> Any:
        """The value of ``key`` if it was computed, else ``default`` (never waits)."""
        return self._values.get(key, default)

    def get(self, key: Any, compute: Callable[[], T]) -> T:
        if key in self._values:
            return self._values[key]
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            if key not in self._values:
                self._values[key] = compute()
            return self._values[key]


def _url_name(prefix: str, taken: set[str]) -> str:
    """A short name for a URL path segment: the prefix's last component in safe characters, made unique."""
    base = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix.rstrip("/").rsplit("/", 1)[-1].partition("?")[0]).strip(".")
    base = base or "dataset"
    name, number = base, 2
    while name in taken:
        name, number = f"{base}-{number}", number + 1
    return name


class Catalog:
    """The datasets named by ``paths`` (dataset prefixes or URIs, and data YAMLs: every dataset of every
    group), opened; with exactly one data YAML, its packs too (the pack index is built in memory, in
    the same way ``mmidx index`` builds it, and nothing is written)."""

    def __init__(self, paths: Sequence[str], geometry: Mapping[str, Any] | None = None):
        """``geometry``: fields of the data YAML's model geometry to replace (``mmidx view --max-latent-size``)."""
        if not paths:
            raise ValueError("give at least one dataset prefix or data YAML to view")
        self.paths = [os.fspath(path) for path in paths]
        self.datasets: dict[str, ViewedDataset] = {}
        self.pack_names: dict[tuple[int, int], str] = {}  # (group, dataset) of the packs' config -> name
        yamls = [path for path in self.paths if is_data_yaml(path)]
        self.config: DataConfig | None = DataConfig.from_yaml(yamls[0]) if len(yamls) == 1 else None
        if self.config is not None and geometry:
            self.config = replace(self.config, geometry=replace(self.config.geometry, **geometry))
        for path in self.paths:
            if is_data_yaml(path):
                config = self.config if self.config is not None else DataConfig.from_yaml(path)
                named = [((g, d), group.name, prefix) for g, group in enumerate(config.groups)
                         for d, prefix in enumerate(group.datasets)]
            else:
                named = [(None, None, path)]
            for position, group, prefix in named:
                name = _url_name(prefix, set(self.datasets))
                self.datasets[name] = ViewedDataset(name, prefix, group, MMIDXDataset(prefix))
                if position is not None and self.config is not None:
                    self.pack_names[position] = name
        if len(yamls) != 1:
            self.packs_note = ("packs are shown for one data YAML (mmidx view data.yaml): "
                               + ("none was given" if not yamls else f"{len(yamls)} were given"))
        else:
            self.packs_note = f"packs of {yamls[0]}"
        self._once = _Once()
        self._started: set[Any] = set()
        self._started_guard = threading.Lock()

    def __getitem__(self, name: str) -> ViewedDataset:
        """The dataset called ``name``; KeyError for any other name."""
        return self.datasets[name]

    def cached(self, key: Any, compute: Callable[[], T]) -> T:
        """``compute()``, once per ``key`` for the catalog's lifetime (concurrent callers wait for the first)."""
        return self._once.get(key, compute)

    def tokenizer(self, name: str) -> tuple[Any, str | None]:
        """(tokenizer or None, why not) of dataset ``name``: the one it was built with, loaded once."""
        dataset = self[name].dataset
        identity = (dataset.tokenizer or {}).get("sha256") or name
        return self.cached(("tokenizer", identity), lambda: dataset_tokenizer(dataset))

    def overview(self, name: str) -> dict[str, Any]:
        """The overview of dataset ``name`` (:func:`mmidx.toolkit.view.stats.overview`), computed once."""
        from mmidx.toolkit.view.stats import overview

        return self.cached(("overview", name), lambda: overview(self[name].dataset))

    def structure(self, name: str) -> str | None:
        """"sound", or the first broken structural invariant of dataset ``name``
        (:meth:`mmidx.read.dataset.MMIDXDataset.check_structure`), or None while it is being checked: the
        first call starts the check in a thread, so no page waits for its O(n) passes."""
        key = ("structure", name)
        with self._started_guard:
            if key not in self._started:
                self._started.add(key)
                threading.Thread(target=self._structure, args=(name,), name="mmidx-view-structure",
                                 daemon=True).start()
        return self._once.peek(key)

    def _structure(self, name: str) -> str:
        def verdict() -> str:
            try:
                self[name].dataset.check_structure()
            except FormatError as error:
                return str(error)
            return "sound"

        return self.cached(("structure", name), verdict)

    def warm(self) -> None:
        """Compute every overview, tokenizer and the pack index now (the server does it in a thread at
        start, so the first pages are served from memory). Best effort: a failure here is met again,
        and reported, by the request that needs the value."""
        for name in self.datasets:
            for compute in (self.overview, self.tokenizer, self._structure):
                try:
                    compute(name)
                except Exception:  # reported by the page that needs it
                    continue
        try:
            self.pack_index()
        except Exception:  # reported by the packs pages
            return

    def pack_index(self) -> Any:
        """The pack index of the data YAML (built on first use), or PacksUnavailable saying why not."""
        if self.config is None:
            raise PacksUnavailable(self.packs_note)
        built = self.cached("pack_index", self._build_packs)
        if isinstance(built, str):
            raise PacksUnavailable(built)
        return built

    def _build_packs(self) -> Any:
        from mmidx.index.pack_index import build_pack_index
        from mmidx.pack.builder import PackBuilder

        try:
            index = build_pack_index(self.config, progress=False)
            # Layout only: images stay encoded (decode_images="device"), so drawing a pack decodes nothing.
            builder = PackBuilder(self.config, use_flex=False, decode_images="device")
        except (ValueError, OSError) as error:  # a config the index refuses: say so on the packs pages
            return f"the pack index of {self.paths} cannot be built: {error}"
        return _Packs(index, builder, pack_token_counts(index, builder.datasets))


@dataclass
class _Packs:
    index: Any  # mmidx.index.pack_index.PackIndex
    builder: Any  # mmidx.pack.builder.PackBuilder
    tokens: np.ndarray  # planned tokens of each pack


def pack_token_counts(index: Any, datasets: list[list[MMIDXDataset]]) -> np.ndarray:
    """Planned tokens of every pack of ``index`` (its samples' view sizes as the index counted them,
    before CFG dropout), from the index arrays and the view table: no pack is built."""
    from mmidx.index.sizes import view_table

    table = view_table(index.config, datasets, index.selections)
    samples = index.arrays["samples"].astype(np.int64)
    views = index.arrays["views"].astype(np.int64) if "views" in index.arrays else 0
    item_tokens = table.view_tokens[table.view_offsets[samples] + views]
    cumulative = np.concatenate([[0], np.cumsum(item_tokens, dtype=np.int64)])
    return np.diff(cumulative[index.arrays["pack_offsets"].astype(np.int64)])
