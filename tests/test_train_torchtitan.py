"""torchtitan (the released package, 0.3.0): mmidx's dataloader satisfies its BaseDataLoader contract as its
trainer uses it, and resumes on another data-parallel size where torchtitan's own loader refuses to.

torchtitan is installed beside the pinned CPU torch with ``pip install --no-deps torchtitan==0.3.0`` (its
package asks for a newer torch and packages its dataloader never imports); the resume through
``torch.distributed.checkpoint`` on 4, 2 and 1 ranks is in tests/test_train_dcp.py.
"""

import pytest
import torch
from support.packs import NUM_SAMPLES, assert_same_batches, pack_dataset, position, write_data_config

torchtitan_dataloader = pytest.importorskip(
    "torchtitan.components.dataloader", reason="torchtitan is not installed: pip install --no-deps torchtitan==0.3.0")
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

from mmidx.train.loader import PackLoader  # noqa: E402
from mmidx.train.torchtitan import PackDataloader  # noqa: E402

IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    folder = tmp_path_factory.mktemp("torchtitan")
    return write_data_config(folder), folder / "cache"


def build(config, dp_rank=0, dp_world_size=1, local_batch_size=1, **options):
    """As torchtitan's Trainer.__init__ builds its dataloader from the job config."""
    path, cache = config
    return PackDataloader.Config(dataset=str(path), num_samples=NUM_SAMPLES, cache_dir=str(cache), use_flex=False,
                                 **options).build(
        dp_rank=dp_rank, dp_world_size=dp_world_size, tokenizer=None, seq_len=2048,
        local_batch_size=local_batch_size, snapshot_every_n_steps=None)


def trainer_steps(dataloader, steps, device="cpu"):
    """The data statements of torchtitan 0.3.0's Trainer (batch_generator, train_step, post_dataloading_process)."""
    seen = []
    data_iterator = iter(dataloader)
    for _ in range(steps):
        try:
            input_dict, labels = next(data_iterator)
        except StopIteration as ex:
            raise torchtitan_dataloader.DataloaderExhaustedError() from ex
        assert int((labels != IGNORE_INDEX).sum()) == labels.numel()  # BAGEL's labels are the loss tokens only
        for key, value in input_dict.items():
            if isinstance(value, torch.Tensor):
                input_dict[key] = value.to(device)
        inputs = input_dict["input"]
        extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
        seen.append(({"input": inputs, **extra_kwargs}, labels.to(device)))
    return seen


def expected_pairs(batches):
    no_text_loss = torch.empty(0, dtype=torch.int64)
    return [({"input": b.tensors["packed_text_ids"], **b.to_dict()}, b.tensors.get("packed_label_ids", no_text_loss))
            for b in batches]


def assert_same_pairs(got, expected):
    assert_same_batches([d for d, _ in got], [d for d, _ in expected])
    assert_same_batches([labels for _, labels in got], [labels for _, labels in expected])


def test_the_adapter_is_torchtitans_dataloader_and_yields_what_its_trainer_reads(config):
    dataloader = build(config)
    assert isinstance(dataloader, torchtitan_dataloader.BaseDataLoader) and isinstance(dataloader, Stateful)
    single = list(PackLoader(pack_dataset(*config), global_batch_size=1))
    assert_same_pairs(trainer_steps(dataloader, len(single)), expected_pairs(single))
    with pytest.raises(torchtitan_dataloader.DataloaderExhaustedError):
        trainer_steps(dataloader, 1)


def test_it_resumes_on_another_dp_size_where_torchtitans_own_loader_refuses(config):
    dataset = pack_dataset(*config)
    theirs = torchtitan_dataloader.ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=2, batch_size=None)
    with pytest.raises(AssertionError, match="resharding is not supported"):
        torchtitan_dataloader.ParallelAwareDataloader(dataset, dp_rank=0, dp_world_size=1, batch_size=None) \
            .load_state_dict(theirs.state_dict())

    single = list(PackLoader(dataset, global_batch_size=2))
    ranks = [build(config, rank, 2, global_batch_size=2) for rank in range(2)]
    first = [trainer_steps(dataloader, 3) for dataloader in ranks]  # 3 optimizer steps of 2 packs
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    assert position(state) == {"packs_consumed": 6, "world_size": 2, "global_batch_size": 2}
    resumed = build(config, global_batch_size=2)
    resumed.load_state_dict(state)
    interleaved = [pair for step in zip(*first, strict=True) for pair in step]
    assert_same_pairs(interleaved + trainer_steps(resumed, len(single) - 6), expected_pairs(single))


def test_a_micro_batch_of_several_packs_or_no_data_yaml_is_refused_with_the_setting_to_change(config):
    with pytest.raises(ValueError, match=r"set training\.local_batch_size = 1"):
        build(config, local_batch_size=8)
    with pytest.raises(ValueError, match=r"set dataloader\.dataset_path to mmidx's data\.yaml"):
        PackDataloader.Config().build(dp_rank=0, dp_world_size=1, local_batch_size=1)


def test_a_global_batch_the_dp_size_cannot_share_is_refused_when_built(config):
    with pytest.raises(ValueError, match="global_batch_size 8 must be a multiple of the world size 3"):
        build(config, 0, 3, global_batch_size=8)


def test_a_checkpoint_of_another_seed_is_refused_unless_strict_resume_is_off(config):
    path, cache = config
    other = path.with_name("other-seed.yaml")
    other.write_text(path.read_text().replace("seed: 5", "seed: 6"))  # the same datasets, another seed
    saved = build(config)
    trainer_steps(saved, 2)
    with pytest.raises(ValueError, match=r"the seed \(5 → 6\) differs\): resume with the config, seed and datasets"):
        build((other, cache)).load_state_dict(saved.state_dict())
    anyway = build((other, cache), strict_resume=False)
    with pytest.warns(UserWarning, match="continuing this stream at pack 2 as strict=False asks"):
        anyway.load_state_dict(saved.state_dict())
    assert position(anyway.state_dict())["packs_consumed"] == 2
