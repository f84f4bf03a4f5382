"""A real lightning.Trainer on the CPU fits a tiny model on mmidx packs, checkpoints, and resumes with the
batches an uninterrupted run has."""

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from support.packs import assert_same_batches, pack_dataset, position, write_data_config

from mmidx.train.lightning import EpochPackLoader, PackDataModule
from mmidx.train.shares import GlobalBatchError
from mmidx.train.state import LoaderStateError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")


class TinyModel(LightningModule):
    """A token embedding and a linear head; records every batch its training_step receives."""

    def __init__(self):
        super().__init__()
        self.embedding = torch.nn.Embedding(1000, 8)
        self.head = torch.nn.Linear(8, 1)
        self.seen = []

    def training_step(self, batch, batch_idx):
        data = batch.to_dict()
        self.seen.append(data)
        return self.head(self.embedding(data["packed_text_ids"])).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(dataset, max_steps=-1, *, ckpt_path=None, callbacks=()):
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      enable_checkpointing=bool(callbacks), callbacks=list(callbacks))
    model = TinyModel()
    trainer.fit(model, datamodule=PackDataModule(dataset, global_batch_size=1), ckpt_path=ckpt_path)
    return model.seen


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return pack_dataset(write_data_config(tmp_path_factory.mktemp("lightning")))


def test_a_new_trainer_with_ckpt_path_sees_the_batches_of_an_uninterrupted_run(dataset, tmp_path):
    uninterrupted = fit(dataset)  # the whole stream: one epoch
    assert len(uninterrupted) == len(dataset)
    checkpoints = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=5, save_top_k=-1)
    first = fit(dataset, 5, callbacks=[checkpoints])  # the resumed epoch ends when its count from 0 reaches len()
    (checkpoint,) = tmp_path.glob("*.ckpt")
    (saved,) = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert position(saved) == {"packs_consumed": 5, "world_size": 1, "global_batch_size": 1}
    assert saved["stream"] == dataset.identity.parts(5)
    rest = fit(dataset, ckpt_path=checkpoint)
    assert_same_batches(first + rest, uninterrupted)


def test_a_checkpoint_of_another_stream_is_refused_and_a_share_that_cannot_divide_is_refused_when_made(dataset,
                                                                                                      tmp_path):
    fit(dataset, 2, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)])
    (checkpoint,) = tmp_path.glob("*.ckpt")
    (tmp_path / "other").mkdir()
    config = write_data_config(tmp_path / "other")
    config.write_text(config.read_text().replace("seed: 5", "seed: 6"))
    with pytest.raises(LoaderStateError, match=r"the seed \(5 → 6\) differs"):
        fit(pack_dataset(config), ckpt_path=checkpoint)
    with pytest.raises(GlobalBatchError, match="global_batch_size 8 must be a multiple of the world size 3"):
        EpochPackLoader(dataset, global_batch_size=8, rank=0, world_size=3)
