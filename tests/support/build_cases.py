"""Small inputs of every kind a build engine must treat alike: t2i, edit, vlm (with a video), text.

Each case is cut into several work units, so that workers, Ray tasks and nodes each get some.
"""

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmidx.format import file_path
from mmidx.toolkit.synthetic import CorpusSpec, write_corpus
from support.sources import tokenizer_dir

DATASET_FILES = ("bin", "idx", "images", "plan", "meta")


@functools.lru_cache(maxsize=1)
def corpus() -> Path:
    """A tiny generated BAGEL-style corpus (once per test process)."""
    root = Path(tempfile.mkdtemp(prefix="mmidx-cases-"))
    write_corpus(root, CorpusSpec(image_size=64, t2i_files=1, t2i_rows=12, edit_files=1, edit_rows=6, edit_images=2,
                                  vlm_lines=16, vlm_images=4, vlm_videos=1, row_group=4))
    with open(root / "docs.jsonl", "w") as stream:
        for line in range(30):
            stream.write(json.dumps({"text": f"document {line} " + "words " * (line % 7)}) + "\n")
    return root


def case(source: str) -> tuple[list[str], dict]:
    """(inputs, source options) of one case; every case has at least three units."""
    root = corpus()
    if source == "t2i":
        return [str(root / "t2i")], {"rows_per_shard": 4, "views": 2}
    if source == "edit":
        return [str(root / "editing" / "seedxedit_multi")], {"rows_per_shard": 2, "views": 2}
    if source == "vlm":
        jsonl = root / "vlm" / "sft.jsonl"
        return [str(jsonl)], {"image_root": str(root / "vlm" / "images"), "views": 2, "min_frames": 2, "max_frames": 3,
                              "bytes_per_shard": os.path.getsize(jsonl) // 4}
    if source == "text":
        docs = root / "docs.jsonl"
        return [str(docs)], {"bytes_per_shard": os.path.getsize(docs) // 3}
    raise ValueError(source)


def cli_options(options: dict) -> list[str]:
    """``options`` as ``mmidx build`` arguments."""
    return [part for key, value in options.items() for part in (f"--{key.replace('_', '-')}", str(value))]


def build_command(source: str, output: str | os.PathLike, *extra: str) -> list[str]:
    inputs, options = case(source)
    return ["build", "--source", source, "--input", *inputs, "--tokenizer", tokenizer_dir(), "--output",
            os.fspath(output), "--quiet", "--max-skip-rate", "1", *cli_options(options), *extra]


def same_dataset_files(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Byte-identical dataset files (the metadata too: outputs are given the same base name)."""
    roles = [role for role in DATASET_FILES if file_path(os.fspath(a), role).exists()]
    return len(roles) >= 3 and all(file_path(os.fspath(b), role).exists() for role in roles) and all(
        file_path(os.fspath(a), role).read_bytes() == file_path(os.fspath(b), role).read_bytes() for role in roles)


def kill_after_first_shard(argv: list[str], output: str | os.PathLike) -> int:
    """Run ``mmidx ARGV`` (a build of ``output``) in a process of its own, kill it and its workers with SIGKILL
    as soon as its first shard is published, and return how many shards were finished by then."""
    return kill_at_first_shard([sys.executable, "-m", "mmidx.cli", *argv], output)


def kill_at_first_shard(command: list[str], output: str | os.PathLike) -> int:
    """:func:`kill_after_first_shard` for any ``command`` that builds ``output`` (a user's script of mmidx.write)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    shards = Path(f"{os.fspath(output)}.shards")
    deadline = time.monotonic() + 60
    while not list(shards.glob("?????/report.json")) and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    assert process.poll() is None, f"the build ended (exit {process.returncode}) before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    return len(list(shards.glob("?????/report.json")))
