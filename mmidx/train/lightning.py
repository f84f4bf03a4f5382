"""Lightning: a ``LightningDataModule`` whose train loader is a :class:`~mmidx.train.loader.PackLoader`.

Lightning saves the state of a train loader that has ``state_dict``/``load_state_dict`` in its
checkpoints and restores it on ``fit(ckpt_path=...)``. A PackLoader counts the packs it handed out,
and Lightning draws no batch ahead of ``training_step`` from a loader with a length, so the
checkpoint holds exactly the packs trained on. Ranks and world size are the Trainer's; mmidx shares
the packs out itself (Lightning replaces the samplers of torch DataLoaders only).
"""

from __future__ import annotations

from mmidx.errors import import_extra
from mmidx.train.loader import PackDataset, PackLoader
from mmidx.train.shares import GlobalBatchSampler

LightningDataModule = import_extra("lightning.pytorch", "lightning", "mmidx.train.lightning").LightningDataModule


class EpochPackLoader(PackLoader):
    """A :class:`PackLoader` whose ``len()`` is the rank's whole stream, resumed part included.

    Lightning counts an epoch's batches from its start (a resumed epoch goes on at batch ``k``) and
    ends it when that count reaches ``len()``.
    """

    def __len__(self) -> int:
        return len(GlobalBatchSampler(len(self.dataset), global_batch_size=self.global_batch_size, rank=self.rank,
                                      world_size=self.world_size))


class PackDataModule(LightningDataModule):
    """Train on mmidx packs with ``lightning.Trainer``; checkpoints resume exactly, at any world size.

    ``dataset``: the packs (:class:`~mmidx.train.loader.PackDataset`); ``global_batch_size``: packs per optimizer
    step over all ranks (one pack per micro-batch: with ``accumulate_grad_batches=a`` on ``w`` devices,
    ``a * w``). ``training_step`` receives :class:`~mmidx.pack.batch.PackedBatch` objects, moved to the
    module's device by Lightning (``batch.to_dict()`` is BAGEL's dict). The stream is one epoch: train
    with ``max_epochs=1`` or ``max_steps``; for more data, index more samples.
    """

    def __init__(self, dataset: PackDataset, *, global_batch_size: int, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int | None = None):
        super().__init__()
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor

    def train_dataloader(self) -> EpochPackLoader:
        return EpochPackLoader(self.dataset, global_batch_size=self.global_batch_size, rank=self.trainer.global_rank,
                               world_size=self.trainer.world_size, num_workers=self.num_workers,
                               pin_memory=self.pin_memory, prefetch_factor=self.prefetch_factor)
