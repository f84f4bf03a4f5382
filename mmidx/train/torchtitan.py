"""torchtitan: its dataloader contract (``BaseDataLoader``) over mmidx packs, resumable on another dp size.

torchtitan's trainer builds its dataloader from the job config, ``config.dataloader.build(dp_rank=,
dp_world_size=, tokenizer=, seq_len=, local_batch_size=, snapshot_every_n_steps=)``, iterates
``(input_dict, labels)`` pairs (``input_dict["input"]`` is the model's input; every other tensor is
moved to the device and passed to the model as a keyword), and its checkpointer saves the loader
with ``torch.distributed.checkpoint`` under the key ``"dataloader"``. Its own
``ParallelAwareDataloader`` keys the state by rank (``{"dp_rank_<r>": <pickled StatefulDataLoader
state>, "world_size": w}``) and refuses to load it at another dp size. :class:`PackDataloader` saves
the :class:`~mmidx.train.loader.PackLoader`'s state instead: the global packs consumed, the same on every
rank (DCP keeps one copy), that loads at any dp size at an optimizer step and refuses another stream
(:mod:`mmidx.train.state`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mmidx.config import DataConfig
from mmidx.errors import import_extra
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.shares import GlobalBatchSampler

BaseDataLoader = import_extra("torchtitan.components.dataloader", "torchtitan", "mmidx.train.torchtitan").BaseDataLoader


class PackDataloader(BaseDataLoader):
    """torchtitan's dataloader over the packs of an mmidx ``data.yaml``: one pack per micro-batch.

    ``input_dict`` is BAGEL's batch dict (``PackedBatch.to_dict()``) plus ``"input"``, the packed text
    ids; ``labels`` is ``packed_label_ids`` (empty for a pack without text loss). A BAGEL-style model
    reads the dict in its trainer's ``post_dataloading_process``. Set ``training.local_batch_size = 1``
    (a pack is a micro-batch); the pack's token budget is the ``data.yaml``'s ``packing``, and the
    datasets are tokenized already, so the trainer's ``seq_len`` and ``tokenizer`` are not used, nor is
    ``snapshot_every_n_steps``: the state is exact after every step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        """``dataset_path`` (or ``dataset``): mmidx's ``data.yaml`` (``mmidx build --config`` writes it)."""

        num_samples: int | None = None
        """Stream length in samples (default: about one epoch of the groups)."""
        cache_dir: str | None = None
        """Where the pack index is cached (rank 0 builds it, the others map it)."""
        global_batch_size: int | None = None
        """Packs per optimizer step over all dp ranks (default: one per rank; × gradient accumulation steps)."""
        num_workers: int = 0
        prefetch_factor: int | None = None
        pin_memory: bool = False
        use_flex: bool = True
        strict_resume: bool = True
        """Refuse a checkpoint of another stream (another seed, config or datasets); False: continue, warned."""

    def __init__(self, config: Config, *, dp_rank: int, dp_world_size: int, local_batch_size: int = 1,
                 tokenizer: Any = None, seq_len: int | None = None, snapshot_every_n_steps: int | None = None):
        if local_batch_size != 1:
            raise ValueError(f"local_batch_size is {local_batch_size}: set training.local_batch_size = 1, a "
                             "micro-batch is one mmidx pack (its tokens set by the data.yaml's packing)")
        path = config.dataset_path or config.dataset
        if not path:
            raise ValueError("set dataloader.dataset_path to mmidx's data.yaml")
        data_config = DataConfig.from_yaml(path)
        global_batch_size = config.global_batch_size or dp_world_size
        GlobalBatchSampler(0, global_batch_size=global_batch_size, rank=dp_rank, world_size=dp_world_size)  # checked
        self.strict_resume = config.strict_resume
        index = build_pack_index(data_config, num_samples=config.num_samples, cache_dir=config.cache_dir)
        self.loader = PackLoader(PackDataset(index, PackBuilder(data_config, use_flex=config.use_flex)),
                                 global_batch_size=global_batch_size, rank=dp_rank,
                                 world_size=dp_world_size, num_workers=config.num_workers,
                                 pin_memory=config.pin_memory, prefetch_factor=config.prefetch_factor)

    def __iter__(self) -> Iterator[tuple[dict[str, Any], torch.Tensor]]:
        for batch in self.loader:
            data = batch.to_dict()
            labels = data.get("packed_label_ids", torch.empty(0, dtype=torch.int64))
            yield {"input": data["packed_text_ids"], **data}, labels

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if state_dict:  # empty: nothing was saved, as ParallelAwareDataloader accepts
            self.loader.load_state_dict(state_dict, strict=self.strict_resume)
