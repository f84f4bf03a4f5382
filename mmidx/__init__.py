"""mmidx: memory-mapped, indexed multimodal datasets for BAGEL-style training, Megatron-compatible.

The names below are imported on first use, so ``import mmidx`` stays light (no torch) for tools
that need only the format.
"""

from importlib import import_module
from typing import Any

from mmidx.format import FormatError

__version__ = "0.1.0"

_EXPORTS = {
    "MMIDXDataset": "mmidx.read.dataset",
    "Sample": "mmidx.read.dataset",
    "DatasetBuilder": "mmidx.ingest.writer",
    "Element": "mmidx.sources.elements",
    "StoredImage": "mmidx.sources.elements",
    "merge_datasets": "mmidx.ingest.merge",
    "write": "mmidx.ingest.function",
    "DataConfig": "mmidx.config",
    "build_pack_index": "mmidx.index.pack_index",
    "PackCosts": "mmidx.index.pack_costs",
    "PackBuilder": "mmidx.pack.builder",
    "PackedBatch": "mmidx.pack.batch",
    "PackDataset": "mmidx.train.loader",
    "PackLoader": "mmidx.train.loader",
    "GlobalBatchSampler": "mmidx.train.shares",
    "PackSampler": "mmidx.train.sampler",
    "GPTTextDataset": "mmidx.train.gpt",
}

__all__ = ["FormatError", "__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mmidx' has no attribute {name!r}")
