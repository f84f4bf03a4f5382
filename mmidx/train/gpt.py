"""Megatron GPT samples over a text dataset: fixed-length windows across document boundaries.

Sample i is Megatron's ``GPTDataset`` sample i for the same sizes, seed, length and flags: the
indices come from :func:`mmidx.index.gpt.gpt_indices` (bit-identical to Megatron's), and the tokens of
all the documents a sample spans are copied in one :meth:`TokenStream.gather` call. Besides
Megatron's ``tokens``/``labels``/``loss_mask``/``position_ids`` it returns ``cu_seqlens``, the
document boundaries inside the sample, for attention kernels that keep documents apart.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from mmidx.errors import option
from mmidx.index.cache import cached_arrays
from mmidx.index.gpt import gpt_indices
from mmidx.read.dataset import MMIDXDataset
from mmidx.read.shards import part_starts

PAD_TOKEN_ID = -1  # Megatron's _PAD_TOKEN_ID when the tokenizer has no pad token


@dataclass(frozen=True)
class GPTIndexConfig:
    """What Megatron's GPT indices of a dataset depend on (besides its sizes); validated on construction."""

    seq_length: int
    num_samples: int | None = None
    seed: int = 1234
    add_extra_token: bool = True
    drop_last: bool = True

    def __post_init__(self) -> None:
        if self.seq_length < 2:
            raise ValueError(f"seq_length must be at least 2 (Megatron's requirement), got {self.seq_length}")
        if self.num_samples is not None and self.num_samples < 1:
            raise ValueError(f"num_samples must be positive or None (one epoch), got {self.num_samples}")
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative (numpy's RandomState), got {self.seed}")


class GPTTextDataset(torch.utils.data.Dataset):
    """Fixed-length text samples of ``seq_length`` tokens, equal to Megatron's ``GPTDataset``.

    ``num_samples`` None means one epoch. ``eod_token_id`` (default: the dataset's recorded end of
    document id) is used by ``eod_mask_loss`` and ``reset_position_ids`` as Megatron uses it.
    """

    def __init__(self, dataset: MMIDXDataset | str | os.PathLike, *, seq_length: int,
                 num_samples: int | None = None, seed: int = 1234, add_extra_token: bool = True,
                 drop_last: bool = True, pad_token_id: int = PAD_TOKEN_ID, eod_token_id: int | None = None,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 cache_dir: str | os.PathLike | None = None):
        self.dataset = dataset if isinstance(dataset, MMIDXDataset) else MMIDXDataset(dataset)
        self.config = GPTIndexConfig(seq_length, num_samples, seed, add_extra_token, drop_last)
        self.seq_length = seq_length
        self.add_extra_token = add_extra_token
        self.pad_token_id = pad_token_id
        self.eod_token_id = self.dataset.special_tokens.get("eod") if eod_token_id is None else eod_token_id
        if (eod_mask_loss or reset_position_ids) and self.eod_token_id is None:
            raise ValueError("eod_mask_loss/reset_position_ids need eod_token_id (the dataset records none)")
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.sequences = Sequences(self.dataset)
        description = {"kind": "gpt_indices", "sequences": self.sequences.count, "config": asdict(self.config),
                       "dataset": self.dataset.checksum}

        def build() -> tuple[dict[str, np.ndarray], dict[str, Any]]:
            self.dataset.check_structure()  # the sample count is sized from the lengths: check them first
            sizes = self.sequences.all_lengths()
            try:
                document, sample, shuffle = gpt_indices(sizes, seq_length=seq_length, num_samples=num_samples,
                                                        seed=seed, add_extra_token=add_extra_token,
                                                        drop_last=drop_last)
            except ValueError as error:  # e.g. too few tokens: say which dataset
                raise ValueError(f"{self.dataset.prefix}: {error}") from error
            except MemoryError as error:  # numpy refuses at once an array far larger than the machine's memory
                raise ValueError(f"{self.dataset.prefix}: {num_samples:,} GPT samples of {seq_length} tokens need "
                                 f"more memory than this machine has ({error}): ask for fewer "
                                 f"({option('num_samples')})") from None
            return {"document_index": document, "sample_index": sample, "shuffle_index": shuffle}, \
                {"samples": len(sample) - 1}

        arrays, _, _ = cached_arrays(cache_dir, description, build)
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def spans(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sequences, offsets, lengths) of the token spans sample ``index`` is made of."""
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} out of range for {len(self)} samples")
        j = int(self.shuffle_index[index])
        (first, first_offset), (last, last_offset) = self.sample_index[j].tolist(), self.sample_index[j + 1].tolist()
        sequences = np.asarray(self.document_index[first:last + 1], dtype=np.int64)
        offsets = np.zeros(len(sequences), dtype=np.int64)
        offsets[0] = first_offset
        lengths = self.sequences.lengths(sequences) - offsets
        lengths[-1] = last_offset - offsets[-1] + self.add_extra_token
        return sequences, offsets, lengths

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        sequences, offsets, lengths = self.spans(index)
        tokens, bounds = self.sequences.gather(sequences, offsets, lengths)
        text = np.full(self.seq_length + self.add_extra_token, self.pad_token_id, dtype=np.int64)
        text[:len(tokens)] = tokens
        text = torch.from_numpy(text)
        if self.add_extra_token:
            inputs, labels = text[:-1].clone(), text[1:].clone()
        else:
            inputs, labels = text.clone(), torch.roll(text, -1)
            labels[-1] = self.pad_token_id
        loss_mask = torch.ones(self.seq_length, dtype=torch.float)
        if self.eod_mask_loss:
            loss_mask[inputs == self.eod_token_id] = 0.0
        loss_mask[labels == self.pad_token_id] = 0.0
        starts = bounds[1:-1]
        starts = starts[starts < self.seq_length]
        position_ids = torch.arange(self.seq_length, dtype=torch.long)
        if self.reset_position_ids:
            for eod in torch.nonzero(inputs == self.eod_token_id).flatten().tolist():
                position_ids[eod + 1:] = torch.arange(self.seq_length - eod - 1)
        inputs[inputs == self.pad_token_id] = 0
        labels[labels == self.pad_token_id] = 0
        cu_seqlens = torch.from_numpy(np.concatenate([[0], starts, [self.seq_length]]).astype(np.int32))
        return {"tokens": inputs, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids,
                "cu_seqlens": cu_seqlens}


class Sequences:
    """The token sequences of a text dataset numbered across its parts (a sharded dataset's shards, in order), as
    Megatron numbers the sequences of the dataset's merge: their lengths and spans, each read from its part."""

    def __init__(self, dataset: MMIDXDataset):
        self.dataset = dataset
        self.starts = part_starts(dataset, "sequences")  # where each part's sequences start, then their total
        self.count = int(self.starts[-1])

    def all_lengths(self) -> np.ndarray:
        """Every sequence's length (Megatron's ``sizes``): the dataset's own array, or its shards' end to end (4
        bytes a sequence: what the GPT indices are built from)."""
        if not self.dataset.is_sharded:
            return self.dataset.tokens.sequence_lengths
        lengths = np.empty(self.count, dtype=np.int32)
        for part, start, end in zip(self.dataset.parts, self.starts[:-1].tolist(), self.starts[1:].tolist(),
                                    strict=True):
            lengths[start:end] = part.dataset.tokens.sequence_lengths
        return lengths

    def _runs(self, sequences: np.ndarray) -> list[tuple[Any, np.ndarray, np.ndarray]]:
        """(part's dataset, positions in ``sequences``, their numbers in the part) of each run of consecutive
        ``sequences`` in one part."""
        if not self.dataset.is_sharded:
            return [(self.dataset, np.arange(len(sequences)), sequences)]
        outside = (sequences < 0) | (sequences >= self.count)
        if outside.any():
            raise IndexError(f"sequence {int(sequences[outside][0])} out of range for {self.count} sequences")
        part = np.searchsorted(self.starts, sequences, side="right") - 1
        edges = [0, *(np.flatnonzero(np.diff(part)) + 1).tolist(), len(sequences)]
        return [(self.dataset.parts[int(part[first])].dataset, np.arange(first, end),
                 sequences[first:end] - self.starts[part[first]]) for first, end in itertools.pairwise(edges)
                if end > first]

    def lengths(self, sequences: np.ndarray) -> np.ndarray:
        """The lengths (int64) of ``sequences``."""
        sequences = np.asarray(sequences, dtype=np.int64)
        lengths = np.empty(len(sequences), dtype=np.int64)
        for dataset, positions, local in self._runs(sequences):
            lengths[positions] = dataset.tokens.sequence_lengths[local]
        return lengths

    def gather(self, sequences: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:meth:`~mmidx.read.dataset.MMIDXDataset.gather` of spans of ``sequences``, each read from its part."""
        runs = self._runs(np.asarray(sequences, dtype=np.int64))
        if len(runs) == 1:
            dataset, _, local = runs[0]
            return dataset.gather(local, offsets, lengths)
        pieces, bounds = [np.zeros(0, self.dataset.token_dtype)], [np.zeros(1, np.int64)]
        for dataset, positions, local in runs:
            tokens, spans = dataset.gather(local, offsets[positions], lengths[positions])
            pieces.append(tokens)
            bounds.append(spans[1:] + bounds[-1][-1])
        return np.concatenate(pieces), np.concatenate(bounds)
