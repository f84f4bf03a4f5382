"""``mmidx precache --engine ray``: encoder batches on Ray actors, written by the driver in order.

Each actor opens the dataset (the prefix must be readable where the actors run, as for a Ray
build), loads the pass's encoders once on its device, and encodes whole batches with the same
:func:`~mmidx.encodings.encode.encode_batch` a local run uses. The driver receives the batches in
their order and appends them to its ``.partial`` files, so the streams are byte-identical to a
local run's and resuming after a killed driver works unchanged. Ray is optional and imported here only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mmidx.encodings.encode import Job, RunOptions, Units, encode_batch, load_encoder
from mmidx.images.transform import ImageTransform
from mmidx.io.ray_cluster import ray_cluster, task_exception
from mmidx.read.dataset import MMIDXDataset


class _EncoderActor:
    """One worker: the dataset opened and the encoder loaded once (at the first batch, so that an error
    doing it reaches the driver as the task's own exception), then batch after batch."""

    def __init__(self, prefix: str, jobs: list[Job], transform: ImageTransform | None, units: Units, device: str):
        self.prefix, self.jobs, self.transform, self.units, self.device = prefix, jobs, transform, units, device
        self.dataset: MMIDXDataset | None = None
        self.encoders: list[Any] | None = None

    def encode(self, b: int, skip: frozenset[int]) -> list[tuple[list[torch.Tensor], str] | None]:
        if self.encoders is None:
            self.dataset = MMIDXDataset(self.prefix)
            self.encoders = [load_encoder(job, self.device) for job in self.jobs]
        return encode_batch(self.dataset, self.jobs, self.transform, self.units, b, self.encoders, self.device,
                            skip=skip)


def ray_batches(prefix: str, jobs: list[Job], transform: ImageTransform | None, units: Units, todo: range,
                skips: list[frozenset[int]], run: RunOptions) -> Iterator[list[tuple[list[torch.Tensor], str] | None]]:
    """Batches ``todo`` encoded on ``run.workers`` actors (one GPU each for a CUDA device), in order."""
    with ray_cluster(run.ray_address, run.workers) as ray:
        gpus = 1 if run.device.startswith("cuda") else 0
        if gpus and ray.cluster_resources().get("GPU", 0) < 1:
            raise ValueError(f"--device {run.device}: the Ray cluster has no GPU; use --device cpu or a GPU cluster")
        actor = ray.remote(num_cpus=1, num_gpus=gpus)(_EncoderActor)
        units_ref = ray.put(units)
        actors = [actor.remote(prefix, jobs, transform, units_ref, run.device) for _ in range(max(1, run.workers))]
        try:
            yield from ray.util.ActorPool(actors).map(lambda worker, task: worker.encode.remote(*task),
                                                      list(zip(todo, skips, strict=True)))
        except ray.exceptions.RayTaskError as error:
            raise task_exception(ray, error) from None
        finally:
            for worker in actors:
                ray.kill(worker)
