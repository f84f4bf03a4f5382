"""Accelerate: mmidx shares the packs out (the loader is kept out of ``prepare``, which would re-shard a torch
DataLoader), ``register_for_checkpointing`` puts its state in ``save_state``, and ``load_state`` resumes it
with the batches an uninterrupted run has."""

import pytest
import torch
from accelerate import Accelerator
from support.packs import assert_same_batches, pack_dataset, position, write_data_config

from mmidx.train.loader import PackLoader


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_dataset(write_data_config(tmp_path_factory.mktemp("accelerate")))


def train(dataset, steps, *, save_to=None, resume_from=None):
    """The README's recipe: ``steps`` optimizer steps; returns the batches the model saw."""
    accelerator = Accelerator()
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 8), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    loader = PackLoader(dataset, global_batch_size=accelerator.num_processes, rank=accelerator.process_index,
                        world_size=accelerator.num_processes, device=accelerator.device)
    accelerator.register_for_checkpointing(loader)
    if resume_from is not None:
        accelerator.load_state(resume_from)
    seen = []
    for batch in loader:
        data = batch.to_dict()
        seen.append(data)
        accelerator.backward(model(data["packed_text_ids"]).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        if len(seen) == steps:  # stop after a step, before drawing a batch that is never trained on
            break
    if save_to is not None:
        accelerator.save_state(save_to)
    return seen


def test_load_state_resumes_the_loader_with_the_batches_of_an_uninterrupted_run(dataset, tmp_path):
    uninterrupted = train(dataset, 9)
    first = train(dataset, 4, save_to=tmp_path / "state")
    saved = torch.load(tmp_path / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert position(saved) == {"packs_consumed": 4, "world_size": 1, "global_batch_size": 1}
    assert saved["stream"] == dataset.identity.parts(4)
    rest = train(dataset, 5, resume_from=tmp_path / "state")
    assert_same_batches(first + rest, uninterrupted)


def test_prepare_hands_an_mmidx_loader_back_unsharded(dataset):
    accelerator = Accelerator()
    loader = PackLoader(dataset, global_batch_size=1)
    assert accelerator.prepare(loader) is loader  # Accelerate wraps and re-shards torch DataLoaders only
