"""``PackedBatch``: one packed batch in BAGEL's layout, with its masks built where it lives.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch

from mmidx.encodings import batch as encoded
from mmidx.encodings.gather import PackRecord
from mmidx.encodings.noise import sample_latents
from mmidx.pack import shared
from mmidx.pack.buffers import _batch_buffer
from mmidx.pack.pixels import DeferredImages, Stage, _ImageJob, _padded_images, _Pixels, _untimed, _vit_tokens
from mmidx.pack.runs import Runs


@dataclass
class _Pack:
    """The lists and runs (:class:`~mmidx.pack.runs.Runs`) one pack accumulates, sample after sample (BAGEL's
    ``sequence_status``)."""

    curr: int = 0
    sample_lens: list[int] = field(default_factory=list)
    split_lens: list[list[int]] = field(default_factory=list)
    attn_modes: list[list[str]] = field(default_factory=list)
    text_ids: list[np.ndarray] = field(default_factory=list)
    text_indexes: Runs = field(default_factory=Runs)
    position_ids: Runs = field(default_factory=Runs)
    label_ids: list[np.ndarray] = field(default_factory=list)
    ce_indexes: Runs = field(default_factory=Runs)
    ce_weights: Runs = field(default_factory=Runs)
    vae_images: list[_ImageJob] = field(default_factory=list)
    vae_latents: list[PackRecord] = field(default_factory=list)  # precached, instead of vae_images
    text_embeddings: list[torch.Tensor] = field(default_factory=list)
    text_embedding_indexes: Runs = field(default_factory=Runs)
    text_encodings: dict[str, list[tuple[torch.Tensor, int, int]]] = field(default_factory=dict)  # (value, sample,
    # element) of each text kept, per text-input encoding used
    vae_shapes: list[tuple[int, int]] = field(default_factory=list)
    latent_position_ids: list[torch.Tensor] = field(default_factory=list)
    vae_indexes: Runs = field(default_factory=Runs)
    timesteps: Runs = field(default_factory=Runs)
    mse_indexes: Runs = field(default_factory=Runs)
    vit_images: list[_ImageJob] = field(default_factory=list)
    vit_embeddings: list[PackRecord] = field(default_factory=list)  # precached, instead of vit_images
    vit_position_ids: list[torch.Tensor] = field(default_factory=list)
    vit_indexes: Runs = field(default_factory=Runs)
    vit_seqlens: list[int] = field(default_factory=list)
    data_indexes: list[dict[str, Any]] = field(default_factory=list)

    def add_special(self, token: int, loss_label: int | None) -> None:
        """One framing token at ``curr``; with a label when the element's special_token_loss is set."""
        self.text_ids.append(np.array([token], dtype=np.int64))
        self.text_indexes.add(self.curr, 1)
        if loss_label is not None:
            self.ce_indexes.add(self.curr, 1)
            self.ce_weights.add(1.0, 1, 0)
            self.label_ids.append(np.array([loss_label], dtype=np.int64))
        self.curr += 1


def _cat(arrays: list[np.ndarray], dtype: Any) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype))


class PackedBatch:
    """One packed batch: BAGEL's keys as tensors, plus the split metadata masks are built from.

    ``to(device)`` (and BAGEL's ``cuda(device)``) moves every tensor and draws there the posterior sample of
    precached moments (:mod:`mmidx.encodings.noise`) and widens precached ViT encodings to float32;
    ``attention_masks()`` / ``to_dict()`` build the masks on the batch's device (dense per-sample masks, or a
    FlexAttention ``BlockMask``), so masks never travel between processes. ``batch_data_indexes`` has one entry per
    sample with BAGEL's ``dataset_name`` (the group), ``worker_id`` (the DataLoader worker that built
    the pack) and ``data_indexes`` ([input file, row]), plus mmidx's ``dataset``, ``sample``, ``view``.
    """

    def __init__(self, tensors: dict[str, Any], *, split_lens: list[list[int]], attn_modes: list[list[str]],
                 sample_lens: list[int], use_flex: bool, max_num_tokens: int,
                 batch_data_indexes: list[dict[str, Any]], deferred: DeferredImages | None = None):
        self.tensors = tensors
        self.deferred = deferred
        self.split_lens = split_lens
        self.attn_modes = attn_modes
        self.sample_lens = sample_lens
        self.use_flex = use_flex
        self.max_num_tokens = max_num_tokens
        self.batch_data_indexes = batch_data_indexes

    @classmethod
    def from_pack(cls, pack: _Pack, *, use_flex: bool, max_num_tokens: int, vit_patch_size: int,
                  deferred: bool = False, stage: Stage = _untimed, noise: tuple[int, int] = (0, 0)) -> PackedBatch:
        pixels = _Pixels([*pack.vae_images, *pack.vit_images], stage)
        if pack.vae_images and pack.vae_latents:
            raise ValueError("a pack mixes VAE images with precached latents: name the vae encodings for every "
                             "group with VAE images (or for none)")
        if pack.vit_images and pack.vit_embeddings:
            raise ValueError("a pack mixes ViT images with precached ViT encodings: name the vit encodings for "
                             "every group with ViT images (or for none)")
        tensors: dict[str, Any] = {
            "packed_text_ids": _cat(pack.text_ids, np.int64),
            "packed_text_indexes": pack.text_indexes.tensor(np.int64),
            "packed_position_ids": pack.position_ids.tensor(np.int64),
        }
        if pack.vae_latents:
            with stage("assemble"):
                tensors.update(encoded.latent_tensors(pack.vae_latents, *noise, _batch_buffer))
        if pack.text_embeddings:
            tensors.update(packed_text_embeddings=torch.cat([value.float() for value in pack.text_embeddings]),
                           packed_text_embedding_indexes=pack.text_embedding_indexes.tensor(np.int64))
        for use, rows in pack.text_encodings.items():
            values, lengths, samples, elements = encoded.text_encoding_keys(use)
            tensors[values], tensors[lengths] = encoded.padded_text_encoding([row[0] for row in rows])
            tensors[samples] = torch.tensor([row[1] for row in rows], dtype=torch.int64)
            tensors[elements] = torch.tensor([row[2] for row in rows], dtype=torch.int64)
        if pack.vae_images or pack.vae_latents:
            if pack.vae_images and not deferred:
                with stage("normalise"):
                    tensors["padded_images"] = _padded_images(pack.vae_images, pixels)
            tensors.update(patchified_vae_latent_shapes=pack.vae_shapes,
                           packed_latent_position_ids=torch.cat(pack.latent_position_ids),
                           packed_vae_token_indexes=pack.vae_indexes.tensor(np.int64))
        if pack.vit_embeddings:
            with stage("assemble"):
                tensors.update(encoded.packed_vit_embeddings(pack.vit_embeddings, _batch_buffer))
        if pack.vit_images or pack.vit_embeddings:
            if pack.vit_images and not deferred:
                with stage("normalise"):
                    tensors["packed_vit_tokens"] = _vit_tokens(pack.vit_images, pack.vit_seqlens, vit_patch_size,
                                                               pixels)
            tensors.update(packed_vit_position_ids=torch.cat(pack.vit_position_ids),
                           packed_vit_token_indexes=pack.vit_indexes.tensor(np.int64),
                           vit_token_seqlens=torch.tensor(pack.vit_seqlens, dtype=torch.int64))
        if pack.timesteps:
            tensors.update(packed_timesteps=pack.timesteps.tensor(np.float32),
                           mse_loss_indexes=pack.mse_indexes.tensor(np.int64))
        if pack.label_ids:
            tensors.update(packed_label_ids=_cat(pack.label_ids, np.int64),
                           ce_loss_indexes=pack.ce_indexes.tensor(np.int64),
                           ce_loss_weights=pack.ce_weights.tensor(np.float32))
        with stage("read"):
            images = DeferredImages.of(pack.vae_images, pack.vit_images, vit_patch_size) \
                if deferred and (pack.vae_images or pack.vit_images) else None
        pool = shared.worker_pool()
        if pool is not None:  # a DataLoader worker: every tensor in the pack's shared memory, handed over as is
            with stage("assemble"):
                tensors = {key: pool.adopt(value) if isinstance(value, torch.Tensor) else value
                           for key, value in tensors.items()}
                if images is not None:
                    images.encoded = [pool.adopt(data) for data in images.encoded]
            pool.seal()
        return cls(tensors, split_lens=pack.split_lens, attn_modes=pack.attn_modes, sample_lens=pack.sample_lens,
                   use_flex=use_flex, max_num_tokens=max_num_tokens, batch_data_indexes=pack.data_indexes,
                   deferred=images)

    @property
    def sequence_length(self) -> int:
        """Tokens of the real samples (without the flex padding pseudo-sample)."""
        return sum(self.sample_lens)

    @property
    def device(self) -> torch.device:
        return self.tensors["packed_text_ids"].device

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self._materialize()
        tensors = self.__dict__.get("tensors", {})
        if name in tensors:
            return tensors[name]
        raise AttributeError(f"PackedBatch has no {name!r} (present keys: {sorted(tensors)})")

    def _materialize(self) -> None:
        """Decode deferred images, sample precached moments and widen precached ViT encodings to float32 where
        the batch is (a no-op for batches decoded in the loader and latents stored as one tensor)."""
        if self.__dict__.get("deferred") is not None:
            self.tensors.update(self.deferred.render(self.device))
            self.deferred = None
        tensors = self.__dict__.get("tensors", {})
        if "padded_latent_moments" in tensors:
            tensors["padded_latent"] = sample_latents(tensors.pop("padded_latent_moments"),
                                                      tensors.pop("latent_sizes"), tensors.pop("latent_noise_key"))
        if "packed_vit_embeddings_stored" in tensors:
            tensors["packed_vit_embeddings"] = tensors.pop("packed_vit_embeddings_stored").float()

    def _map(self, function: Any, deferred: DeferredImages | None) -> PackedBatch:
        tensors = {key: function(value) if isinstance(value, torch.Tensor) else value
                   for key, value in self.tensors.items()}
        return PackedBatch(tensors, split_lens=self.split_lens, attn_modes=self.attn_modes,
                           sample_lens=self.sample_lens, use_flex=self.use_flex, max_num_tokens=self.max_num_tokens,
                           batch_data_indexes=self.batch_data_indexes, deferred=deferred)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """The batch with every tensor on ``device`` (deferred images are decoded there)."""
        moved = self._map(lambda tensor: tensor.to(device, non_blocking=non_blocking), self.deferred)
        moved._materialize()
        return moved

    def cuda(self, device: torch.device | str | int | None = None, non_blocking: bool = False) -> PackedBatch:
        """BAGEL's ``SimpleCustomBatch.cuda(device)``: :meth:`to` with a CUDA device (an int is its index)."""
        if device is None or isinstance(device, int):
            device = torch.device("cuda", device)
        return self.to(device, non_blocking=non_blocking)

    def pin_memory(self) -> PackedBatch:
        """Page-locked copies (``DataLoader(pin_memory=True)`` calls this); deferred images stay encoded."""
        return self._map(lambda tensor: tensor.pin_memory(),
                         None if self.deferred is None else self.deferred.pin_memory())

    def flat_split_metadata(self, *, pad: bool) -> tuple[list[int], list[str], list[int]]:
        """(split_lens, attn_modes, sample_lens) over the whole pack, with the flex padding sample if ``pad``."""
        split_lens = [length for sample in self.split_lens for length in sample]
        attn_modes = [mode for sample in self.attn_modes for mode in sample]
        sample_lens = list(self.sample_lens)
        if pad:
            pad_len = self.max_num_tokens - self.sequence_length
            split_lens.append(pad_len)
            attn_modes.append("causal")
            sample_lens.append(pad_len)
        return split_lens, attn_modes, sample_lens

    def attention_masks(self, *, dtype: torch.dtype = torch.float32) -> Any:
        """Masks on the batch's device: a ``BlockMask`` (flex) or one dense (L_i, L_i) mask per sample."""
        from mmidx.pack import masks

        if self.use_flex:
            return masks.block_mask(*self.flat_split_metadata(pad=True), device=self.device)
        return masks.dense_masks(*self.flat_split_metadata(pad=False), device=self.device, dtype=dtype)

    def to_dict(self) -> dict[str, Any]:
        """BAGEL's batch dict: every present key, with ``nested_attention_masks`` (dense) built on the
        batch's device, or ``split_lens``/``attn_modes`` with the padding pseudo-sample (flex)."""
        self._materialize()
        split_lens, attn_modes, sample_lens = self.flat_split_metadata(pad=self.use_flex)
        data: dict[str, Any] = {"sequence_length": self.sequence_length, "sample_lens": sample_lens}
        data.update(self.tensors)
        if self.use_flex:
            data.update(split_lens=split_lens, attn_modes=attn_modes)
        else:
            data["nested_attention_masks"] = self.attention_masks()
        data["batch_data_indexes"] = self.batch_data_indexes
        return data


def _reduce_batch(batch: PackedBatch) -> tuple[Any, tuple[Any, ...]]:
    """``ForkingPickler``'s reduction of a batch (a DataLoader worker's hand-over): the tensors in the worker's
    shared memory as their places in it (:mod:`mmidx.pack.shared`), the rest pickled as usual."""
    state = dict(batch.__dict__)
    pool = shared.worker_pool()
    if pool is None:
        return _rebuild_batch, (state, [])
    handed: list[Any] = []
    places: list[shared.Place] = []

    def placed(value: Any) -> Any:
        place = pool.place_of(value, handed) if isinstance(value, torch.Tensor) else None
        if place is None:
            return value
        places.append(place)
        return place

    state["tensors"] = {key: placed(value) for key, value in batch.tensors.items()}
    if batch.deferred is not None:
        state["deferred"] = dataclasses.replace(batch.deferred, encoded=[placed(data) for data in
                                                                         batch.deferred.encoded])
    return _rebuild_batch, (state, pool.hand_over(handed, places))


def _rebuild_batch(state: dict[str, Any], handles: list[tuple[Any, int]]) -> PackedBatch:
    """The batch :func:`_reduce_batch` sent, its tensors viewing the worker's shared memory."""
    arrays = shared.attach(handles)

    def tensor(value: Any) -> Any:
        return value.tensor(arrays) if isinstance(value, shared.Place) else value

    state["tensors"] = {key: tensor(value) for key, value in state["tensors"].items()}
    if state["deferred"] is not None:
        state["deferred"].encoded = [tensor(data) for data in state["deferred"].encoded]
    batch = PackedBatch.__new__(PackedBatch)
    batch.__dict__.update(state)
    return batch


ForkingPickler.register(PackedBatch, _reduce_batch)
