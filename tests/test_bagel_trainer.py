"""BAGEL's trainer loop (train/pretrain_unified_navit.py), data side, line by line on mmidx batches.

The loop below repeats the trainer's data statements in order: ``data.cuda(device).to_dict()``,
the pops, the token and sample counts, the VAE encode's key swap, ``fsdp_model(**data)``'s keyword
set, the ``data_status`` bookkeeping, the checkpoint's ``torch.save`` of one ``data_status`` per
rank and its ``torch.load(weights_only=True)`` on resume.
"""

from types import SimpleNamespace

import pytest
import torch
import yaml
from support.packing import GEOMETRY, SPECIAL, build_groups
from support.packs import position

from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index, pack_index_costs
from mmidx.pack.batch import PackedBatch
from mmidx.train.bagel import LOADER_STATE_NAME, trainer_loader
from mmidx.train.shares import GlobalBatchError
from mmidx.train.state import LoaderStateError

# Bagel.forward's parameters (modeling/bagel/bagel.py): everything the trainer passes as **data
FORWARD_PARAMETERS = {
    "sequence_length", "packed_text_ids", "packed_text_indexes", "sample_lens", "packed_position_ids",
    "nested_attention_masks", "split_lens", "attn_modes", "ce_loss_indexes", "packed_label_ids",
    "packed_vit_tokens", "packed_vit_token_indexes", "packed_vit_position_ids", "vit_token_seqlens",
    "padded_latent", "patchified_vae_latent_shapes", "packed_latent_position_ids", "packed_vae_token_indexes",
    "packed_timesteps", "mse_loss_indexes"}

PACKING = {"max_num_tokens": 1200, "expected_num_tokens": 800, "max_num_tokens_per_sample": 1200,
           "prefer_buffer_before": 400, "max_buffer_size": 4}  # small packs: a few samples each

# BAGEL's DataConfig after the trainer set it from model_args (visual_gen and visual_und on)
BAGEL_DATA_CONFIG = SimpleNamespace(text_cond_dropout_prob=0.3, vit_cond_dropout_prob=0.3, vae_cond_dropout_prob=0.3,
                                    vae_image_downsample=16, max_latent_size=64, vit_patch_size=14,
                                    max_num_patch_per_side=70)


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trainer")
    path = folder / "data.yaml"
    path.write_text(yaml.safe_dump({"groups": build_groups(folder), "geometry": GEOMETRY, "seed": 3}))
    return path


def loader_of(config_file, data_status=None, *, use_flex=True, num_workers=0, local_rank=0, world_size=1, **more):
    return trainer_loader(config_file, BAGEL_DATA_CONFIG, local_rank=local_rank, world_size=world_size,
                          num_workers=num_workers, use_flex=use_flex, data_status=data_status,
                          special_tokens=SPECIAL, **{"data_seed": 7, "num_samples": 200, **PACKING, **more})


def train(train_loader, total_steps, data_status=None, train_step=0, device="cpu"):
    """The trainer's loop with the model calls replaced by checks; returns (what each step saw, data_status)."""
    seen = []
    for micro_step, data in enumerate(train_loader):
        curr_step = train_step + micro_step
        if curr_step >= total_steps:
            break
        data = data.cuda(device).to_dict()
        data_indexes = data.pop("batch_data_indexes", None)
        ce_loss_weights = data.pop("ce_loss_weights", None)
        tokens = float(data["sequence_length"])
        if data["sample_lens"]:
            sample_lens = torch.tensor(data["sample_lens"], dtype=torch.float32, device=device)
            assert torch.dot(sample_lens, sample_lens) > 0
        if "padded_images" in data:  # data['padded_latent'] = vae_model.encode(data.pop('padded_images'))
            data["padded_latent"] = data.pop("padded_images")
        assert set(data) <= FORWARD_PARAMETERS, set(data) - FORWARD_PARAMETERS
        if "ce_loss_indexes" in data:
            assert len(ce_loss_weights) == len(data["ce_loss_indexes"]) == len(data["packed_label_ids"])
        if "mse_loss_indexes" in data:
            assert len(data["mse_loss_indexes"]) <= len(data["packed_timesteps"])
        assert all(t.device.type == torch.device(device).type for t in data.values() if isinstance(t, torch.Tensor))

        if data_status is None:
            data_status = {}
        for item in data_indexes:
            if item["dataset_name"] not in data_status.keys():
                data_status[item["dataset_name"]] = {}
            data_status[item["dataset_name"]][item["worker_id"]] = item["data_indexes"]
        seen.append((tokens, data["packed_text_ids"].tolist(), data["packed_position_ids"].tolist()))
    return seen, data_status


def checkpoint_round_trip(tmp_path, data_status, world_size=1):
    """FSDPCheckpoint: rank 0 saves the gathered list; each rank loads its own entry with weights_only."""
    path = tmp_path / "data_status.pt"
    torch.save([data_status] * world_size, path)
    return torch.load(path, weights_only=True, map_location="cpu")


@pytest.mark.parametrize("use_flex", [True, False])
def test_the_trainer_loop_runs_unchanged_and_resumes_with_the_same_next_batches(config_file, tmp_path, use_flex):
    uninterrupted, _ = train(loader_of(config_file, use_flex=use_flex), total_steps=5)
    assert len(uninterrupted) == 5
    first, data_status = train(loader_of(config_file, use_flex=use_flex), total_steps=2)
    assert list(data_status[LOADER_STATE_NAME]) == [0]
    assert position(data_status[LOADER_STATE_NAME][0]) == {"packs_consumed": 2, "world_size": 1, "global_batch_size": 1}
    groups = set(data_status) - {LOADER_STATE_NAME}
    assert groups and groups <= {"t2i", "edit", "vlm"}
    assert all(set(status) == {0} for status in data_status.values())  # worker ids, as BAGEL records them
    resumed_status = checkpoint_round_trip(tmp_path, data_status)[0]
    rest, _ = train(loader_of(config_file, resumed_status, use_flex=use_flex), total_steps=5, train_step=2,
                    data_status=resumed_status)
    assert first + rest == uninterrupted


def test_worker_ids_are_the_dataloader_workers_that_built_the_packs(config_file):
    _, data_status = train(loader_of(config_file, num_workers=2), total_steps=4)
    sample_workers = {worker for name, status in data_status.items() if name != LOADER_STATE_NAME for worker in status}
    assert sample_workers == {0, 1}
    assert position(data_status[LOADER_STATE_NAME][0])["packs_consumed"] == 4


def test_each_rank_resumes_from_its_own_data_status(config_file, tmp_path):
    ranks = [train(loader_of(config_file, local_rank=r, world_size=2), total_steps=3)[0] for r in range(2)]
    statuses = [train(loader_of(config_file, local_rank=r, world_size=2), total_steps=1)[1] for r in range(2)]
    path = tmp_path / "data_status.pt"
    torch.save(statuses, path)
    for rank in range(2):
        status = torch.load(path, weights_only=True, map_location="cpu")[rank]
        assert position(status[LOADER_STATE_NAME][0]) == {"packs_consumed": 2, "world_size": 2, "global_batch_size": 2}
        rest, _ = train(loader_of(config_file, status, local_rank=rank, world_size=2), total_steps=3, train_step=1)
        assert rest == ranks[rank][1:]


def test_a_data_status_from_bagels_own_loader_is_refused_with_the_way_out(config_file):
    with pytest.raises(ValueError, match="pass data_status=None"):
        loader_of(config_file, {"t2i_pretrain": {0: [0, 0, 5]}})


def test_mismatched_special_tokens_are_refused(config_file):
    with pytest.raises(ValueError, match="special token ids differ"):
        trainer_loader(config_file, special_tokens={**SPECIAL, "eos_token_id": 99})


def test_cuda_with_a_device_index_is_to_on_that_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(PackedBatch, "to", lambda self, device, non_blocking=False: calls.append(device))
    batch = PackedBatch({}, split_lens=[], attn_modes=[], sample_lens=[], use_flex=True, max_num_tokens=1,
                        batch_data_indexes=[])
    batch.cuda(1)
    batch.cuda()
    assert calls == [torch.device("cuda", 1), torch.device("cuda")]


def test_the_yamls_packing_policy_is_kept_and_the_trainers_budgets_replace_the_yamls(config_file, tmp_path):
    tight = tmp_path / "tight.yaml"
    data = yaml.safe_load(config_file.read_text())
    data["packing"] = {"policy": "tight", "window": 32, "cost_slack": 0.02, "max_num_tokens": 9999,
                       "max_num_tokens_per_sample": 9000, "expected_num_tokens": 5000}
    tight.write_text(yaml.safe_dump(data))
    index = loader_of(tight).dataset.packs
    packing = index.config.packing
    assert (packing.policy, packing.window, packing.cost_slack) == ("tight", 32, 0.02)
    assert {key: getattr(packing, key) for key in PACKING} == PACKING  # the trainer's, not the YAML's 9999
    by_hand = DataConfig.from_dict({**data, "packing": {**data["packing"], **PACKING}, "seed": 7})
    expected = build_pack_index(by_hand, num_samples=200, progress=False)
    packs = [index.items(k) for k in range(len(index))]
    assert packs == [expected.items(k) for k in range(len(expected))]
    bagel = build_pack_index(DataConfig.from_dict({**data, "packing": PACKING, "seed": 7}), num_samples=200,
                             progress=False)
    assert packs != [bagel.items(k) for k in range(len(bagel))]  # what the policy dropped would have trained


def test_a_global_batch_over_the_world_size_deals_balanced_steps_and_one_it_cannot_share_is_refused(config_file):
    loader = loader_of(config_file, local_rank=1, world_size=2, global_batch_size=4)
    costs = pack_index_costs(loader.dataset.packs)
    assert loader.pack_costs is not None and list(loader.pack_costs[:]) == list(costs)  # after CFG dropout
    dealt = list(loader.sampler())
    assert dealt[:2] == sorted(range(4), key=lambda k: (-costs[k], k))[1::2]  # rank 1: the 2nd and 4th dearest
    assert loader_of(config_file, world_size=2).pack_costs is None  # BAGEL's loop: one pack per rank, no deal
    with pytest.raises(GlobalBatchError, match="global_batch_size 8 must be a multiple of the world size 3"):
        loader_of(config_file, world_size=3, global_batch_size=8)


def test_a_data_status_of_another_seed_is_refused_unless_strict_is_off_and_an_older_one_is_warned(config_file):
    _, data_status = train(loader_of(config_file), total_steps=3)
    with pytest.raises(LoaderStateError, match=r"the seed \(7 → 8\) differs"):
        loader_of(config_file, data_status, data_seed=8)
    with pytest.warns(UserWarning, match="continuing this stream at pack 3 as strict=False asks"):
        assert loader_of(config_file, data_status, data_seed=8, strict=False).steps_consumed == 3
    older = {**data_status, LOADER_STATE_NAME: {0: {"packs_consumed": 3, "world_size": 1}}}  # as mmidx saved it
    with pytest.warns(UserWarning, match="records no stream"):
        assert loader_of(config_file, older, data_seed=8).steps_consumed == 3
