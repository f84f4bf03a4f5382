"""Shared test setup: offline Hugging Face, quiet Megatron imports, and small dataset factories."""

import os
import warnings

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
warnings.filterwarnings("ignore", module="megatron")
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")


@pytest.fixture(scope="session")
def demo(tmp_path_factory):
    """The quick demo (build, index, packs) in a relative folder, as the README's command runs it."""
    from mmidx.demo import run

    folder = tmp_path_factory.mktemp("cwd")
    steps = []  # each step's line, and whether the datasets existed when it was told
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(folder)
        result = run("mmidx-demo", quick=True,
                     progress=lambda line: steps.append((line, os.path.exists("mmidx-demo/datasets/data.yaml"))))
    return {**result, "steps": steps}
