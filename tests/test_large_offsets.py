"""Offsets are 64-bit: a sparse .bin larger than 4 GiB reads its last sequence correctly."""

import numpy as np

from mmidx import format as fmt
from mmidx.read.dataset import MMIDXDataset


def test_last_sequence_of_an_8_gib_sparse_bin(tmp_path):
    longest = np.iinfo(np.int32).max  # the largest sequence length MMIDIDX can record
    lengths = np.array([longest, longest, 5], dtype=np.int64)
    fmt.write_token_index(tmp_path / "big.idx", np.dtype(np.uint16), lengths, np.array([0, 2, 3]))
    last = np.array([11, 22, 33, 44, 55], dtype=np.uint16)
    start = 2 * longest * 2
    assert start > 2**32
    with open(tmp_path / "big.bin", "wb") as stream:  # sparse: only the last page is written
        stream.seek(start)
        stream.write(last.tobytes())
    dataset = MMIDXDataset(tmp_path / "big")
    assert dataset.tokens.sequence_pointers[-1] == start
    assert dataset.get_tokens(2).tolist() == last.tolist()
    assert dataset.get_tokens(-1, 3).tolist() == [44, 55]
    assert dataset.get_tokens(1, longest - 2).tolist() == [0, 0]
    tokens, bounds = dataset.gather([2, 2], [4, 0], [1, 2])
    assert tokens.tolist() == [55, 11, 22] and bounds.tolist() == [0, 1, 3]
    import megatron.core.datasets.indexed_dataset as megatron
    assert megatron.IndexedDataset(str(tmp_path / "big")).get(2).tolist() == last.tolist()
