"""A drop-in for the data side of BAGEL's trainer (``train/pretrain_unified_navit.py``).

BAGEL's loop does ``data = data.cuda(device).to_dict()``, pops ``batch_data_indexes`` and records
``data_status[entry["dataset_name"]][entry["worker_id"]] = entry["data_indexes"]`` for every entry;
``data_status`` is saved with each checkpoint and handed back to the data pipeline on resume.
:func:`trainer_loader` takes the arguments BAGEL gives its ``PackedDataset`` and returns a loader whose
batches satisfy that loop unchanged. mmidx's own resume state (``loader.state_dict()``, the packs consumed and
the stream: :mod:`mmidx.train.state`) rides along as one more entry of ``batch_data_indexes`` under the
dataset name :data:`LOADER_STATE_NAME`, so the trainer's bookkeeping saves it beside BAGEL's per-sample
entries and :meth:`TrainerLoader.load_state_dict` reads it back from ``data_status``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

import torch

from mmidx.config import DataConfig, DropoutConfig, ModelGeometry
from mmidx.index.history import MixtureHistory, resumed_history
from mmidx.index.pack_costs import PackCosts
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.batch import PackedBatch
from mmidx.pack.builder import SPECIAL_TOKEN_NAMES, PackBuilder
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.shares import GlobalBatchSampler
from mmidx.train.state import LoaderStateError

LOADER_STATE_NAME = "mmidx"


class TrainerLoader(PackLoader):
    """A :class:`PackLoader` whose batches also carry the loader's resume state (see the module docstring)."""

    def __iter__(self) -> Iterator[PackedBatch]:
        for batch in super().__iter__():
            batch.batch_data_indexes = [*batch.batch_data_indexes, {
                "dataset_name": LOADER_STATE_NAME, "worker_id": 0, "data_indexes": self.state_dict()}]
            yield batch

    def load_state_dict(self, state: Mapping[str, Any], strict: bool = True) -> None:
        """Resume from ``loader.state_dict()`` or from one rank's BAGEL ``data_status`` that holds it."""
        super().load_state_dict(loader_state_of(state), strict=strict)


def loader_state_of(data_status: Mapping[str, Any]) -> Mapping[str, Any]:
    """mmidx's loader state in one rank's BAGEL ``data_status`` (or the loader state itself)."""
    if LOADER_STATE_NAME in data_status:
        return data_status[LOADER_STATE_NAME][0]
    if "packs_consumed" not in data_status:
        raise LoaderStateError(f"data_status has no {LOADER_STATE_NAME!r} entry (datasets {sorted(data_status)}): it "
                               "was saved by BAGEL's own loader; pass data_status=None to start mmidx's data afresh")
    return data_status


def trainer_loader(config_file: str | os.PathLike, dataset_config: Any = None, *, local_rank: int = 0,
                   world_size: int = 1, num_workers: int = 0, expected_num_tokens: int = 32768,
                   max_num_tokens_per_sample: int = 16384, max_num_tokens: int = 36864,
                   prefer_buffer_before: int = 16384, max_buffer_size: int = 50, interpolate_pos: bool = False,
                   use_flex: bool = False, data_status: Mapping[str, Any] | None = None,
                   special_tokens: Mapping[str, int] | None = None, data_seed: int | None = None,
                   num_samples: int | None = None, cache_dir: str | os.PathLike | None = None,
                   prefetch_factor: int | None = None, pin_memory: bool | None = None,
                   history: str | os.PathLike | None = None, global_batch_size: int | None = None,
                   strict: bool = True) -> TrainerLoader:
    """The loader that replaces BAGEL's ``PackedDataset`` + ``DataLoader`` in its trainer.

    ``config_file``: mmidx's ``data.yaml`` (``mmidx build --config`` writes it). ``dataset_config``:
    BAGEL's ``DataConfig`` object after the trainer set it up; its dropout probabilities and model
    geometry replace the YAML's, as they do in BAGEL. The keywords are ``PackedDataset``'s, plus
    ``data_seed`` (BAGEL's ``set_epoch`` seed), ``num_samples`` (stream length; default about one
    epoch), ``cache_dir`` (where the pack index is cached). The trainer's token budgets replace the YAML's
    ``packing`` budgets; its ``policy``, ``window`` and ``cost_slack`` are the YAML's. Each rank takes one
    pack per micro-step; ``global_batch_size``: packs per optimizer step over all ranks (default: the world
    size, BAGEL's loop; a trainer that accumulates gradients passes world size × steps), dealt by cost
    (balanced steps: each pack's cost after CFG dropout, :class:`~mmidx.index.pack_costs.PackCosts`) when it exceeds
    the world size.
    ``history``: the run's mixture history file (:mod:`mmidx.index.history`; e.g. beside the cache): a resume
    whose data.yaml changed the weights or schedule continues with them from the end of the global batch it
    was saved in, recorded there, and one that would change consumed packs is refused; ``mmidx index
    --history`` rebuilds its packs. A ``data_status`` of another stream (another seed, config, datasets, or
    weights changed without a history) is refused; ``strict=False`` continues this stream anyway, warned.
    """
    config = DataConfig.from_yaml(config_file)
    geometry = replace(config.geometry, interpolate_pos=interpolate_pos)
    dropout = config.dropout
    if dataset_config is not None:
        dropout = DropoutConfig(text=dataset_config.text_cond_dropout_prob, vit=dataset_config.vit_cond_dropout_prob,
                                vae=dataset_config.vae_cond_dropout_prob)
        geometry = ModelGeometry(vit_patch_size=dataset_config.vit_patch_size,
                                 max_num_patch_per_side=dataset_config.max_num_patch_per_side,
                                 vae_image_downsample=dataset_config.vae_image_downsample,
                                 max_latent_size=dataset_config.max_latent_size, interpolate_pos=interpolate_pos)
    packing = replace(config.packing, expected_num_tokens=expected_num_tokens, max_num_tokens=max_num_tokens,
                      max_num_tokens_per_sample=max_num_tokens_per_sample, prefer_buffer_before=prefer_buffer_before,
                      max_buffer_size=max_buffer_size)  # the budgets are the trainer's; the policy is the YAML's
    config = replace(config, packing=packing, dropout=dropout, geometry=geometry,
                     seed=config.seed if data_seed is None else data_seed)
    builder = PackBuilder(config, use_flex=use_flex)
    if special_tokens is not None:
        differ = {name: (special_tokens[name], builder.special_tokens[name])
                  for name in SPECIAL_TOKEN_NAMES if special_tokens.get(name) != builder.special_tokens[name]}
        if differ:
            raise ValueError(f"the trainer's special token ids differ from the datasets' (trainer, datasets): "
                             f"{differ}; build the datasets with the trainer's tokenizer")
    global_batch_size = world_size if global_batch_size is None else global_batch_size
    GlobalBatchSampler(0, global_batch_size=global_batch_size, rank=local_rank, world_size=world_size)  # checked
    state = None if data_status is None else loader_state_of(data_status)
    if state is not None and "global_batch_size" not in state:  # an older mmidx's: its world size was its batch
        state = {**state, "global_batch_size": state.get("world_size", world_size)}
    mixture: DataConfig | MixtureHistory = config
    if history is not None:
        mixture = resumed_history(history, config, state or 0, write=local_rank == 0)
    index = build_pack_index(mixture, num_samples=num_samples, cache_dir=cache_dir)
    loader = TrainerLoader(PackDataset(index, builder), global_batch_size=global_batch_size, rank=local_rank,
                           world_size=world_size, num_workers=num_workers, prefetch_factor=prefetch_factor,
                           pin_memory=torch.cuda.is_available() if pin_memory is None else pin_memory,
                           pack_costs=PackCosts(index, config=config, datasets=builder.datasets)
                           if global_batch_size > world_size else None)
    if state is not None:
        loader.load_state_dict(state, strict=strict)
    return loader
