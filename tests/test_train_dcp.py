"""torch.distributed.checkpoint: a state saved by 4 gloo ranks loads on 2 ranks, then on 1, and the three runs
together train on the single process's global pack sequence, batch for batch (the PackLoader, and torchtitan's
dataloader contract checkpointed under its trainer's key)."""

import importlib.util
import socket

import pytest
import torch
from support.dcp_ranks import GLOBAL_BATCH, run, spawn
from support.packs import assert_same_batches, pack_dataset, write_data_config

from mmidx.train.loader import PackLoader

TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
PHASES = [(4, 2), (2, 4), (1, 8)]  # (world size, micro-steps per rank): 2 global batches of 4 packs each


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single process's whole stream, and the folder where world 4, then 2, then 1 trained and saved."""
    folder = tmp_path_factory.mktemp("dcp")
    write_data_config(folder)
    single = list(PackLoader(pack_dataset(folder / "data.yaml", folder / "cache"), global_batch_size=GLOBAL_BATCH))
    assert len(single) == 24
    for phase, (world_size, steps) in enumerate(PHASES):
        if world_size > 1:
            spawn(world_size, free_port(), folder, phase, steps, TORCHTITAN)
        else:
            run(0, 1, folder, phase, steps, TORCHTITAN)  # this process: no process group, as in a 1-GPU job
    return folder, single


def global_sequence(folder, name):
    """Every phase's batches in global order: each global batch is rank 0's share, then rank 1's, ..."""
    sequence = []
    for phase, (world_size, steps) in enumerate(PHASES):
        shares = [torch.load(folder / f"seen-{phase}-{rank}.pt", weights_only=False)[name]
                  for rank in range(world_size)]
        per_rank = GLOBAL_BATCH // world_size
        assert all(len(share) == steps for share in shares)
        sequence += [batch for step in range(0, steps, per_rank) for share in shares
                     for batch in share[step:step + per_rank]]
    return sequence


@pytest.mark.timeout(900)  # over half the default: its fixture runs 7 DCP processes: 254 s at a load of 20
def test_a_checkpoint_of_4_ranks_resumes_on_2_then_1_with_the_single_process_batches(runs):
    folder, single = runs
    assert_same_batches(global_sequence(folder, "loader"), single)


@pytest.mark.skipif(not TORCHTITAN, reason="torchtitan is not installed: pip install --no-deps torchtitan==0.3.0")
def test_torchtitans_dataloader_resumes_on_another_dp_size_with_the_single_process_batches(runs):
    folder, single = runs
    pairs = global_sequence(folder, "dataloader")
    assert_same_batches([input_dict for input_dict, _ in pairs],
                        [{"input": batch.tensors["packed_text_ids"], **batch.to_dict()} for batch in single])
    no_text_loss = torch.empty(0, dtype=torch.int64)
    assert_same_batches([labels for _, labels in pairs],
                        [batch.tensors.get("packed_label_ids", no_text_loss) for batch in single])
