"""Shared test setup: offline Hugging Face, quiet Megatron imports, and small dataset factories."""

import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", module="megatron")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
