"""mmidx: memory-mapped, indexed multimodal datasets for BAGEL-style training, Megatron-compatible."""

from mmidx.format import FormatError

__version__ = "0.1.0"

__all__ = ["FormatError", "__version__"]
