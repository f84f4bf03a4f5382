"""Scale in file handles: a data config of thousands of datasets indexes and trains under a low descriptor limit
(each process here runs with ``ulimit -n`` far below what one descriptor per mapped file would need)."""

import os
import subprocess
import sys

import pytest
import yaml
from support.sources import tokenizer_dir

from mmidx.ingest.shard import load_tokenizer
from mmidx.toolkit.scale_data import write_synthetic

TRAIN = """
import resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from mmidx.config import DataConfig
from mmidx.index.pack_index import build_pack_index
from mmidx.pack.builder import PackBuilder
from mmidx.train.loader import PackDataset, PackLoader
config = DataConfig.from_yaml(sys.argv[1])
index = build_pack_index(config)
batch = next(iter(PackLoader(PackDataset(index, PackBuilder(config)), global_batch_size=1)))
samples = sorted((item.group, item.dataset, item.sample) for item in index.items(0))
print(len(index), len(samples), sum(batch.sample_lens) > 0)
"""
TRANSFORM = {"image_stride": 16, "max_image_size": 64, "min_image_size": 16}
PACKING = {"max_num_tokens": 2048, "expected_num_tokens": 1500, "max_num_tokens_per_sample": 1024}


def test_a_missing_special_token_names_a_few_datasets_not_thousands(tmp_path):
    from mmidx.config import DataConfig
    from mmidx.pack.builder import PackBuilder

    prefixes = [os.fspath(write_synthetic(tmp_path / f"d{k}", 1)) for k in range(50)]
    config = DataConfig.from_dict({"groups": {"t2i": {"datasets": prefixes, "image_transform_args": TRANSFORM}},
                                   "packing": PACKING})
    with pytest.raises(ValueError, match=r"d0, .*d1, .*d10 and 47 more datasets record none") as error:
        PackBuilder(config)
    assert len(str(error.value)) < 600


def run(script: str, *args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=240,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.split()


def test_a_group_of_two_thousand_datasets_indexes_and_trains_under_128_descriptors(tmp_path):
    tokenizer = load_tokenizer(tokenizer_dir())
    prefixes = [os.fspath(write_synthetic(tmp_path / f"d{k}", 3, seed=k, tokenizer=tokenizer)) for k in range(2000)]
    config = tmp_path / "data.yaml"
    config.write_text(yaml.safe_dump({"groups": {"t2i": {"datasets": prefixes, "image_transform_args": TRANSFORM}},
                                      "packing": PACKING}))
    packs, items, filled = run(TRAIN, os.fspath(config))
    assert int(packs) > 0 and int(items) > 0 and filled == "True"

