"""Blending several datasets into one sample order: ``blending_indices``, ``exhaustive_blending_indices``.

Guarantee: equal to helpers.cpp's ``build_blending_indices`` / ``build_exhaustive_blending_indices`` as
``BlendedDataset`` calls them (weights normalised by ``w / sum(w)`` in float64): sample s goes to the
dataset with the largest ``weight * max(s, 1) - taken``, ties to the lowest index. Sample counters are
int64; the dataset index is int16 up to 32,767 datasets (as Megatron's) and int32 beyond, where Megatron
stops. The kernels are ``csrc/_blending.pyx``.
"""

from __future__ import annotations

import numpy as np

from mmidx import _blending


def blending_indices(weights: np.ndarray | list[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) of a ``size``-sample blend, as Megatron's BlendedDataset.

    Sample s comes from dataset ``dataset_index[s]`` and is its ``dataset_sample_index[s]``-th
    sample; weights are normalised like Megatron's ``normalize`` (the builder normalises once more
    before BlendedDataset; pass it its normalised weights to match that path exactly).
    """
    normalised = _normalize(weights)
    if size < 0:
        raise ValueError(f"size must be non-negative, got {size}")
    dataset_index = np.empty(size, dtype=_dataset_index_dtype(len(normalised)))
    dataset_sample_index = np.empty(size, dtype=np.int64)
    _blending.build_blending_indices(normalised, dataset_index, dataset_sample_index, np.zeros(len(normalised)), 0)
    return dataset_index, dataset_sample_index


def exhaustive_blending_indices(sizes: np.ndarray | list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) taking exactly ``sizes[d]`` samples of each dataset d,
    interleaved in proportion to the sizes, as Megatron's BlendedDataset with ``size=None``."""
    counts = np.asarray(sizes)
    if counts.ndim != 1 or counts.size == 0 or not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("sizes must be a non-empty 1-D array of sample counts")
    if int(counts.min()) <= 0:
        raise ValueError("every dataset of an exhaustive blend needs at least one sample; drop empty ones")
    counts = np.ascontiguousarray(counts, dtype=np.int64)
    total = int(counts.sum())
    dataset_index = np.empty(total, dtype=_dataset_index_dtype(len(counts)))
    dataset_sample_index = np.empty(total, dtype=np.int64)
    _blending.build_exhaustive_blending_indices(counts, dataset_index, dataset_sample_index)
    return dataset_index, dataset_sample_index


def checked_weights(weights: np.ndarray | list[float]) -> np.ndarray:
    """``weights`` in float64, checked: a non-empty 1-D sequence of finite, positive numbers."""
    w = np.array(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0:
        raise ValueError("weights must be a non-empty 1-D sequence, one weight per dataset")
    if not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError("weights must be finite and positive; leave out the datasets you do not want")
    return w


def _normalize(weights: np.ndarray | list[float]) -> np.ndarray:
    """Megatron's ``normalize``: ``w / sum(w)`` in float64, after checking the weights."""
    w = checked_weights(weights)
    return w / np.sum(w)


def _dataset_index_dtype(num_datasets: int) -> type:
    return np.int16 if num_datasets <= np.iinfo(np.int16).max else np.int32
