"""A pack of samples → one batch in the layout of BAGEL's ``PackedDataset`` (``BAGEL_SEMANTICS.md``).

For every sample of a pack, element by element, this reproduces BAGEL's ``pack_sequence``: text
framed by ``<|im_start|>``/``<|im_end|>`` with labels shifted by one and weights 1/sqrt(n+1),
images framed by ``<|vision_start|>``/``<|vision_end|>``, rope ids (text +len, vit +1, clean vae
+1, noised vae +0, frame_delta, a gap for each dropped image and none for dropped text), splits
and attention modes, ViT patches with NaViT position ids, padded VAE inputs with latent position
ids, one timestep per noised image or clip (-inf for clean ones), and the key groups present only
when non-empty. It reproduces BAGEL's quirks too: a split is reset at ``split_start`` before CFG
dropout is decided, text and vit position ids advance by the running split length.

Differences, by design: a clip whose first or last frame is dropped by CFG dropout opens its split
on the first kept frame and closes it on the last kept one (BAGEL then writes ``split_lens`` and
``attn_modes`` of different lengths and ``sample_lens`` shorter than the tokens written);
randomness (CFG dropout, timesteps) comes from Philox keyed by (seed, pack index, sample position)
— no global RNG, so pack k is the same in any process, worker or resumed run; each stored image
is decoded once per pack however many elements use it; attention masks are not built here (split
metadata travels; :mod:`mmidx.pack.masks` builds masks on the device).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import numpy as np
import torch

from mmidx import format as fmt
from mmidx.config import DataConfig, GroupConfig
from mmidx.encodings import batch as encoded
from mmidx.encodings.gather import PackRecord
from mmidx.format import FormatError
from mmidx.images.patches import position_ids_extrapolate, position_ids_interpolate
from mmidx.images.transform import ImageTransform
from mmidx.index.dropout import cfg_dropped, sample_randomness
from mmidx.index.pack_index import PackItem
from mmidx.pack.batch import PackedBatch, _Pack
from mmidx.pack.pixels import Stage, _ImageJob, _output_size, _position_ids, _untimed
from mmidx.read.dataset import MMIDXDataset, Sample
from mmidx.read.encoding_streams import open_stream

SPECIAL_TOKEN_NAMES = fmt.PACK_SPECIAL_TOKENS  # the ids a pack needs (verify checks each dataset names them)


_ELEMENT_FIELDS = ("kind", "flags", "img_num", "frame_delta", "special_token_label", "payload")


if fmt.ELEMENT_DTYPE.names != _ELEMENT_FIELDS:  # _add_sample unpacks plan records in this order
    raise ImportError(f"mmidx.format's element fields {fmt.ELEMENT_DTYPE.names} are not {_ELEMENT_FIELDS}")


class PackBuilder:
    """Turns packs (lists of :class:`PackItem`) into :class:`PackedBatch` objects for one data config.

    ``datasets[g][d]`` is dataset d of group g (opened from the config when not given). Holds no
    mapped state that cannot be pickled: datasets re-map lazily in each worker.

    ``decode_images="loader"`` (default) decodes and transforms images where the batch is built,
    with BAGEL's exact pixels. ``"device"`` puts the encoded images in the batch instead and
    decodes them where it moves (:class:`DeferredImages`): JPEGs on the GPU with nvJPEG when
    torchvision is installed, resized with torch's antialiased bicubic in PIL's two passes (within
    2 levels of PIL's pixels),
    so loader workers ship compressed bytes and spend no time on pixels.

    ``stage`` (benchmarks, :mod:`mmidx.toolkit.bench`): called with a stage name ("read", "decode",
    "resize", "normalise", "assemble"), it returns a context manager that times that stage; by
    default a shared no-op, so building costs the same as without it.

    ``encodings`` ({"vae": NAME, "vit": NAME, "text": NAME}, else each group's ``encodings``) uses
    precached encodings (:mod:`mmidx.encodings`): VAE elements bring ``padded_latent`` instead of
    ``padded_images`` (their images are never decoded); with "vit" (a frozen ViT's precached
    patch-embedding outputs), ViT elements bring ``packed_vit_embeddings`` (tokens, D) in the rows of
    ``packed_vit_tokens``, which is left out; texts bring ``packed_text_embeddings`` at
    ``packed_text_embedding_indexes``; any other use names a text-input encoding (one record per text,
    keys in :mod:`mmidx.encodings.batch`); streams computed from other inputs are refused.

    ``cache_dir``, ``cache_limit``: where the datasets it opens (unless ``datasets`` are given) cache, as
    :class:`~mmidx.read.dataset.MMIDXDataset` takes them (a data cache for datasets in object storage).
    """

    def __init__(self, config: DataConfig, *, use_flex: bool = True,
                 datasets: Sequence[Sequence[MMIDXDataset]] | None = None,
                 special_tokens: dict[str, int] | None = None, decode_images: str = "loader",
                 stage: Stage = _untimed, encodings: dict[str, str] | None = None,
                 cache_dir: str | os.PathLike | None = None, cache_limit: int | str | None = None):
        if decode_images not in ("loader", "device"):
            raise ValueError(f"decode_images is 'loader' (exact BAGEL pixels, decoded where the batch is built) or "
                             f"'device' (encoded bytes travel, decoded where the batch moves), not {decode_images!r}")
        self.config = config
        self.use_flex = use_flex
        self.decode_images = decode_images
        self.stage = stage
        self.datasets = [list(group) for group in datasets] if datasets is not None else \
            [[MMIDXDataset(prefix, cache_dir=cache_dir, cache_limit=cache_limit) for prefix in group.datasets]
             for group in config.groups]
        self.special_tokens = special_tokens or self._special_tokens_of_datasets()
        images = any(dataset.kind == "multimodal" for group in self.datasets for dataset in group)
        needed = [name for name in SPECIAL_TOKEN_NAMES if images or name not in fmt.IMAGE_SPECIAL_TOKENS]
        missing = [name for name in needed if name not in self.special_tokens]
        if missing:
            lacking = sorted({dataset.prefix for group in self.datasets for dataset in group
                              if any(not isinstance(dataset.special_tokens.get(name), int) for name in missing)})
            named = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more datasets" if len(lacking) > 3 else "")
            verb = "record" if len(lacking) > 1 else "records"
            raise ValueError(f"special token ids {missing} are unknown: {named or 'no dataset'} {verb} none (null "
                             "or missing in its metadata's special_tokens): build the datasets with mmidx's "
                             "tokenizer or pass special_tokens")
        self.encodings = encoded.group_encodings(config, encodings)
        encoded.checked_streams(config, self.datasets, self.encodings)
        self._text_uses = [{use: name for use, name in uses.items() if use not in ("vae", "vit")}
                           for uses in self.encodings]  # per group: the uses a kept text looks up
        geometry = config.geometry
        self._position_ids = functools.partial(
            _position_ids, position_ids_interpolate if geometry.interpolate_pos else position_ids_extrapolate)

    def _special_tokens_of_datasets(self) -> dict[str, int]:
        found: dict[str, int] = {}
        for group in self.datasets:
            for dataset in group:
                for name in SPECIAL_TOKEN_NAMES:
                    value = dataset.special_tokens.get(name)
                    if value is not None and found.setdefault(name, value) != value:
                        raise ValueError(f"datasets disagree on the id of {name} ({found[name]} vs {value}); "
                                         "mix only datasets built with the same tokenizer")
        return found

    def build(self, pack_index: int, items: Sequence[PackItem]) -> PackedBatch:
        """The batch of pack ``pack_index`` made of ``items``, in order."""
        pack = _Pack()
        worker = torch.utils.data.get_worker_info()
        worker_id = 0 if worker is None else worker.id
        for position, item in enumerate(items):
            dataset = self.datasets[item.group][item.dataset]
            with self.stage("read"):
                sample = dataset[item.sample]
                elements = sample.elements(item.view)
            uniforms, normals = sample_randomness(self.config.seed, pack_index, position, len(elements))
            self._add_sample(pack, item, sample, elements, uniforms, normals)
            pack.data_indexes.append({
                "dataset_name": self.config.groups[item.group].name, "worker_id": worker_id,
                "data_indexes": list(sample.origin), "dataset": dataset.prefix, "sample": item.sample,
                "view": item.view})
        return PackedBatch.from_pack(pack, use_flex=self.use_flex, max_num_tokens=self.config.packing.max_num_tokens,
                                     vit_patch_size=self.config.geometry.vit_patch_size,
                                     deferred=self.decode_images == "device", stage=self.stage,
                                     noise=(self.config.seed, pack_index))

    @staticmethod
    def _job(transform: ImageTransform | None, group: GroupConfig, kind: str, item: PackItem, sample: Sample,
             payload: int, img_num: int) -> _ImageJob:
        if transform is None:
            raise ValueError(f"group {group.name!r} has {kind} images but no image_transform_args in its config")
        image = sample.image(payload)
        height, width = _output_size(transform, image.width, image.height, img_num)
        return _ImageJob((item.group, item.dataset, item.sample, payload), sample, transform, img_num, height, width)

    @staticmethod
    def _stored_image(sample: Sample, job: _ImageJob) -> int:
        """The dataset-wide number of the stored image of ``job`` (what encoding streams are keyed by)."""
        return int(sample.dataset.plan["sample_image_offsets"][sample.index]) + job.key[3]

    @staticmethod
    def _text_encodings(pack: _Pack, uses: dict[str, str], sample: Sample, payload: int, length: int,
                        element: int) -> None:
        """The precached encodings of a kept text: token-aligned rows at its tokens' indexes ("text"), and a
        record per text-input encoding used."""
        first = sample.dataset.tokens.document_range(sample.index)[0]
        for use, name in uses.items():
            if use == "text":
                pack.text_embeddings.append(encoded.text_embedding(open_stream(sample.dataset, name), first + payload,
                                                                   length))
                pack.text_embedding_indexes.add(pack.curr + 1, length)
            elif use not in encoded.USES:
                value = encoded.text_embedding(open_stream(sample.dataset, name), first + payload, None)
                pack.text_encodings.setdefault(use, []).append((value, len(pack.sample_lens), element))

    def _add_sample(self, pack: _Pack, item: PackItem, sample: Sample,
                    elements: np.ndarray, uniforms: np.ndarray, normals: np.ndarray) -> None:
        group: GroupConfig = self.config.groups[item.group]
        geometry, special = self.config.geometry, self.special_tokens
        split_lens: list[int] = []
        attn_modes: list[str] = []
        rope = 0
        first_token = pack.curr
        split_len = 0
        timestep = None
        sample_len = 0
        opening = False  # a split has started and none of its elements is kept yet
        split_open = False  # a split holds kept elements and is not closed yet
        uses, text_uses = self.encodings[item.group], self._text_uses[item.group]
        dropped = cfg_dropped(elements["kind"], elements["flags"], uniforms, self.config.dropout).tolist()
        # One tuple of Python ints per record (_ELEMENT_FIELDS' order): cheaper than reading fields.
        for e, (kind, flags, img_num, frame_delta, label, payload) in enumerate(elements.tolist()):
            special_loss_label = label if flags & fmt.FLAG_SPECIAL_TOKEN_LOSS else None
            if flags & fmt.FLAG_SPLIT_START:
                split_len = 0
                opening = True
            if dropped[e]:
                rope += kind != fmt.TEXT  # a dropped image leaves a rope gap, a dropped text none
                if flags & fmt.FLAG_SPLIT_END and split_open:  # a clip's last frame: close on the last kept one
                    split_lens.append(split_len)
                    sample_len += split_len
                    split_open = False
                continue
            opens, opening, split_open = opening, False, True
            if kind == fmt.TEXT:
                ids = sample.text(payload).astype(np.int64)
                shifted = len(ids) + 1
                if text_uses:
                    self._text_encodings(pack, text_uses, sample, payload, len(ids), e)
                pack.text_ids.append(np.concatenate([[special["bos_token_id"]], ids]))
                pack.text_indexes.add(pack.curr, shifted)
                if flags & fmt.FLAG_LOSS:
                    pack.ce_indexes.add(pack.curr, shifted)
                    pack.ce_weights.add(1 / shifted**0.5, shifted, 0)  # BAGEL's len2weight
                    pack.label_ids.append(np.concatenate([ids, [special["eos_token_id"]]]))
                pack.curr += shifted
                split_len += shifted
                pack.add_special(special["eos_token_id"], special_loss_label)
                split_len += 1
                attn_modes.append("causal")
                pack.position_ids.add(rope, split_len)
                rope += split_len
            elif kind == fmt.VIT_IMAGE:
                pack.add_special(special["start_of_image"], None)
                split_len += 1
                job = self._job(group.vit_transform, group, "vit", item, sample, payload, img_num)
                patch = geometry.vit_patch_size
                tokens = (job.height // patch) * (job.width // patch)
                pack.vit_indexes.add(pack.curr, tokens)
                pack.curr += tokens
                split_len += tokens
                if "vit" in uses:
                    pack.vit_embeddings.append(PackRecord(
                        open_stream(sample.dataset, uses["vit"]), self._stored_image(sample, job), job.img_num,
                        (job.height // patch, job.width // patch)))
                else:
                    pack.vit_images.append(job)
                pack.vit_seqlens.append(tokens)
                pack.vit_position_ids.append(self._position_ids(
                    job.height, job.width, patch, geometry.max_num_patch_per_side))
                pack.add_special(special["end_of_image"], special_loss_label)
                split_len += 1
                attn_modes.append("full")
                pack.position_ids.add(rope, split_len, 0)
                rope += 1
            else:
                pack.add_special(special["start_of_image"], None)
                split_len += 1
                job = self._job(group.vae_transform, group, "vae", item, sample, payload, img_num)
                down = geometry.vae_image_downsample
                height, width = job.height // down, job.width // down
                latent_tokens = height * width
                if "vae" in uses:
                    pack.vae_latents.append(PackRecord(open_stream(sample.dataset, uses["vae"]),
                                                       self._stored_image(sample, job), job.img_num,
                                                       (job.height, job.width, down)))
                else:
                    pack.vae_images.append(job)
                pack.vae_shapes.append((height, width))
                pack.latent_position_ids.append(self._position_ids(
                    job.height, job.width, down, geometry.max_latent_size))
                pack.vae_indexes.add(pack.curr, latent_tokens)
                noised = bool(flags & fmt.FLAG_LOSS)
                if noised:
                    pack.mse_indexes.add(pack.curr, latent_tokens)
                    if opens or timestep is None:
                        timestep = float(normals[e])
                    value = timestep
                else:
                    value = float("-inf")
                pack.timesteps.add(value, latent_tokens, 0)
                pack.curr += latent_tokens
                split_len += latent_tokens
                pack.add_special(special["end_of_image"], special_loss_label)
                split_len += 1
                has_frame_delta = bool(flags & fmt.FLAG_HAS_FRAME_DELTA)
                if opens:  # a clip's first frame: the split opens on the first kept one
                    attn_modes.append("noise" if noised and not has_frame_delta else "full")
                pack.position_ids.add(rope, latent_tokens + 2, 0)
                if has_frame_delta:
                    rope += frame_delta
                elif not noised:
                    rope += 1
            if flags & fmt.FLAG_SPLIT_END:
                split_lens.append(split_len)
                sample_len += split_len
                split_open = False
        if len(split_lens) != len(attn_modes) or sample_len != pack.curr - first_token:
            raise FormatError(f"{sample.dataset.prefix}.plan: view {item.view} of sample {item.sample}: the split "
                              "flags (split_start, split_end) of its elements do not make whole splits: corrupted")
        pack.sample_lens.append(sample_len)
        pack.split_lens.append(split_lens)
        pack.attn_modes.append(attn_modes)


