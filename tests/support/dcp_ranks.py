"""One rank of a gloo process group that resumes mmidx loaders from a DCP checkpoint, trains on, and saves.

Run by ``torch.multiprocessing`` (spawn) from tests/test_train_dcp.py; a rank writes the batches it saw
to ``folder/seen-<phase>-<rank>.pt`` for the test to compare with a single process's.
"""

from __future__ import annotations

import multiprocessing.connection
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from mmidx.train.loader import PackLoader
from support.packs import NUM_SAMPLES, pack_dataset, record, take

GLOBAL_BATCH = 4


def loaders(folder: Path, rank: int, world_size: int, torchtitan: bool) -> dict:
    """The checkpointed objects: a PackLoader, and (``torchtitan``) the torchtitan adapter under torchtitan's key."""
    config = folder / "data.yaml"
    loader = PackLoader(pack_dataset(config, folder / "cache"), global_batch_size=GLOBAL_BATCH, rank=rank,
                        world_size=world_size)
    if not torchtitan:
        return {"loader": loader}
    from torchtitan.components.checkpointer import DATALOADER

    from mmidx.train.torchtitan import PackDataloader

    titan = PackDataloader.Config(dataset=str(config), num_samples=NUM_SAMPLES, cache_dir=str(folder / "cache"),
                                  global_batch_size=GLOBAL_BATCH, use_flex=False).build(
        dp_rank=rank, dp_world_size=world_size, tokenizer=None, seq_len=2048, local_batch_size=1,
        snapshot_every_n_steps=None)  # the keywords torchtitan's trainer builds its dataloader with
    return {"loader": loader, DATALOADER: titan}


def run(rank: int, world_size: int, folder: Path, phase: int, steps: int, torchtitan: bool) -> None:
    """Load checkpoint ``phase - 1`` (if any), take ``steps`` micro-steps from each loader, save ``phase``."""
    states = loaders(folder, rank, world_size, torchtitan)
    if phase:
        dcp.load(states, checkpoint_id=folder / f"checkpoint-{phase - 1}")
    seen = {name: take(loader, steps) for name, loader in states.items()}
    dcp.save(states, checkpoint_id=folder / f"checkpoint-{phase}")
    torch.save({**seen, "loader": [record(batch) for batch in seen["loader"]]}, folder / f"seen-{phase}-{rank}.pt")


def _rank(rank: int, world_size: int, port: int, folder: Path, phase: int, steps: int, torchtitan: bool) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    try:
        run(rank, world_size, folder, phase, steps, torchtitan)
    finally:
        dist.destroy_process_group()


def spawn(world_size: int, port: int, folder: Path, phase: int, steps: int, torchtitan: bool,
          timeout: float = 150) -> None:
    """Run :func:`run` on ``world_size`` spawned ranks; kill them all if they take over ``timeout`` s."""
    context = mp.start_processes(_rank, args=(world_size, port, folder, phase, steps, torchtitan), nprocs=world_size,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(0.1, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            multiprocessing.connection.wait([p.sentinel for p in context.processes], timeout=10)
            raise TimeoutError(f"world size {world_size} took over {timeout} s")
