"""mmidx: memory-mapped, indexed multimodal datasets for BAGEL-style training, Megatron-compatible.

The names below are imported on first use, so ``import mmidx`` stays light (no torch) for tools
that need only the format.
"""

from importlib import import_module
from typing import Any

from mmidx.format import FormatError

__version__ = "0.1.0"

_EXPORTS = {
    "MMIDXDataset": "mmidx.dataset",
    "Sample": "mmidx.dataset",
    "DatasetBuilder": "mmidx.builder",
    "Element": "mmidx.builder",
    "StoredImage": "mmidx.builder",
    "merge_datasets": "mmidx.builder",
    "DataConfig": "mmidx.config",
    "build_pack_index": "mmidx.pack_index",
    "PackBuilder": "mmidx.packing",
    "PackedBatch": "mmidx.packing",
    "PackDataset": "mmidx.loader",
    "PackLoader": "mmidx.loader",
    "GlobalBatchSampler": "mmidx.loader",
    "PackSampler": "mmidx.train.sampler",
    "GPTTextDataset": "mmidx.gpt",
}

__all__ = ["FormatError", "__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mmidx' has no attribute {name!r}")
