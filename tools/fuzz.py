"""Mutation fuzzer of mmidx's readers: no byte pattern in any file may crash, hang or lie.

Builds small datasets of every kind (text, t2i, edit, vlm with video frames, prompts with extra
JSON), each with a same-shape twin, then runs cases: case ``c`` mutates one base dataset in a way
drawn from ``(seed, c)`` alone (byte flips, aligned 4/8-byte boundary values, truncation,
extension, a file swapped with the twin's, the twin's (stale) metadata, a deleted file, JSON
fields replaced by wrong types; the metadata re-signed afterwards in some cases, i.e. checksums
recomputed) and, in a worker subprocess, reads everything a job reads: every sample, text, image,
view and extra; a token gather; GPT samples; a pack index; every pack's batch with images decoded in the
loader (the first two also on the device and from precached latents), with dense and flex masks, the
special token ids taken from the dataset as a job takes them; then ``mmidx verify --decode``.

Outcomes: ``clean error`` (FormatError/IndexError/ValueError whose message names the dataset's files),
``identical`` (everything read equals the unmutated dataset's), ``different, caught by verify``,
``different, unguarded`` (checksums recomputed after the edit, so the data is simply other data, or an
encoding's re-signed JSON records another transform, which the packer then refuses for this config; or the
metadata of a text dataset deleted, which leaves a bare Megatron pair that no checksum guards, as
``mmidx verify`` then says), ``different and missed`` (a lie), ``verify passed, read failed`` (a reader
or the packer refused what ``mmidx verify`` passed: verify must check every invariant they enforce),
``crash`` (the worker died: a reproducer is written), ``hang`` (past ``--case-timeout``) and ``other
exception``.
Exits 1 unless there were no crashes, hangs, other exceptions or missed differences.

    python tools/fuzz.py --cases 2000 --jobs 2 --out /tmp/fuzz
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's mmidx

ROLES = ("idx", "bin", "images", "plan", "meta", "enc.bin", "enc.idx", "enc.json")  # enc.*: a precached encoding
ENCODING = "fz"
KINDS = ("text", "t2i", "edit", "vlm", "prompts")
SPECIAL = {"bos_token_id": 1, "eos_token_id": 2, "start_of_image": 3, "end_of_image": 4, "eod": 5}
VAE = {"image_stride": 16, "max_image_size": 64, "min_image_size": 32}
VIT = {"image_stride": 14, "max_image_size": 56, "min_image_size": 28}
GEOMETRY = {"vit_patch_size": 14, "max_num_patch_per_side": 70, "vae_image_downsample": 16, "max_latent_size": 64}
PACKING = {"max_num_tokens": 320, "expected_num_tokens": 200, "max_num_tokens_per_sample": 300,
           "prefer_buffer_before": 100, "max_buffer_size": 4}
BOUNDARY = (0, 1, -1, 2**31 - 1, -(2**31), 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, -(2**63), 2**63 - 8,
            2**40, 255, 256, 65535, 65536)
JSON_VALUES = (None, True, False, 0, -1, 2**31, 2**63, 2**64, 1.5, "", "x", [], {}, [1], {"a": 1})
OUTCOMES = ("clean error", "identical", "different, caught by verify", "different, unguarded",
            "different and missed", "verify passed, read failed", "crash", "hang", "other exception")
BAD_OUTCOMES = ("different and missed", "verify passed, read failed", "crash", "hang", "other exception")


# --------------------------------------------------------------------------- base datasets


def _image(rng: np.random.Generator, mode: str, fmt_name: str, width: int, height: int) -> Any:
    import io

    from PIL import Image

    from mmidx.sources.elements import StoredImage

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB").convert(mode)
    stream = io.BytesIO()
    image.save(stream, fmt_name)
    return StoredImage(stream.getvalue(), width, height, fmt_name, mode, image.has_transparency_data)


def build_base(folder: Path, kind: str, seed: int) -> Path:
    """A small dataset of ``kind``; the twin (seed + 1) has the same shape, other tokens and pixels."""
    from mmidx.ingest.writer import DatasetBuilder
    from mmidx.sources.elements import Element

    rng = np.random.default_rng(0)  # the shape: the same for a dataset and its twin
    content = np.random.default_rng(seed)  # the content
    prefix = folder / f"{kind}-{seed}"

    def text(low: int = 1, high: int = 9) -> list[int]:
        return (10 + content.integers(0, 400, int(rng.integers(low, high)))).tolist()

    def image(mode: str = "RGB", fmt_name: str = "PNG") -> Any:
        width, height = (int(v) for v in rng.integers(20, 60, 2))
        return _image(content, mode, fmt_name, width, height)

    if kind == "text":
        with DatasetBuilder(prefix, kind="text", vocab_size=1000, special_tokens=SPECIAL) as builder:
            for _ in range(5):
                builder.add_document([[*text(1, 12), SPECIAL["eod"]]])
            builder.finalize()
        return prefix
    with DatasetBuilder(prefix, vocab_size=1000, special_tokens=SPECIAL) as builder:
        source = builder.source_id("input.jsonl")
        for row in range(3):
            if kind == "t2i":
                builder.add_sample([text(), text()], [image()],
                                   [[Element("text", v, enable_cfg=True), Element("vae_image", 0, loss=True)]
                                    for v in range(2)], (source, row))
            elif kind == "edit":
                steps = [Element("vae_image", 0, enable_cfg=True), Element("vit_image", 0, enable_cfg=True),
                         Element("text", 0, enable_cfg=True), Element("vae_image", 1, loss=True)]
                builder.add_sample([text()], [image("RGB", "JPEG"), image("RGBA")], [steps], (source, row))
            elif kind == "vlm":
                if row < 2:
                    count = row + 1
                    plan = [Element("text", 0)] + [Element("vit_image", j, img_num=count) for j in range(count)]
                    plan += [Element("text", 1, loss=True, special_token_loss=True, special_token_label=7)]
                    builder.add_sample([text(), text()], [image("L") for _ in range(count)], [plan], (source, row))
                else:  # a video: frames advancing the rope by their frame_delta
                    clip = [Element("vae_image", j, loss=True, split_start=j == 0, split_end=j == 2,
                                    frame_delta=2 if j < 2 else None) for j in range(3)]
                    builder.add_sample([text()], [image() for _ in range(3)],
                                       [[Element("text", 0, loss=True), *clip]], (source, row))
            else:  # prompts: a text and a JPEG (the one base without an encoding to go stale), with per-sample JSON
                extra = {"prompt_id": f"p{row}-{int(content.integers(1000))}", "metadata": {"tags": ["a", row]}}
                builder.add_sample([text()], [image("RGB", "JPEG")], [[Element("text", 0, loss=True),
                                                                        Element("vit_image", 0)]], (source, row), extra)
        builder.finalize()
    if kind in ("t2i", "edit"):  # VAE moments of an average-pooling "encoder", 8x down
        import torch

        from mmidx.encodings.encode import Job
        from mmidx.encodings.precache import precache_dataset
        from mmidx.images.transform import ImageTransform

        def encoder(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            mean = torch.nn.functional.avg_pool2d(images, 8)
            return mean, mean.abs() - 2

        precache_dataset(str(prefix), Job(ENCODING, "fuzz:avg_pool", dtype="fp32", batch_size=2),
                         ImageTransform.from_args(VAE), progress=False, encoder=encoder)
    return prefix


def role_path(prefix: Path, role: str) -> Path:
    from mmidx import format as fmt

    if role.startswith("enc."):
        return fmt.encoding_path(prefix, ENCODING, role[4:])
    return fmt.file_path(prefix, role)


def files_of(prefix: Path) -> dict[str, bytes]:
    return {role: path.read_bytes() for role in ROLES if (path := role_path(prefix, role)).exists()}


# --------------------------------------------------------------------------- mutations


def _words(role: str, data: bytes, rng: np.random.Generator) -> tuple[int, int]:
    """(offset, width) of a 4- or 8-byte word aligned within the array it falls in."""
    from mmidx import format as fmt

    width = int(rng.choice([4, 8]))
    if role == "idx" and len(data) >= fmt.MEGATRON_HEADER_SIZE:
        n = int.from_bytes(data[18:26], "little")
        regions = [(fmt.MEGATRON_HEADER_SIZE, 4 * n, 4), (fmt.MEGATRON_HEADER_SIZE + 4 * n, len(data), 8),
                   (0, fmt.MEGATRON_HEADER_SIZE, 1)]
        start, end, width = regions[int(rng.integers(len(regions)))]
        if end - start < width:
            start, end, width = 0, len(data), 1
        return start + int(rng.integers(0, (end - start) // width)) * width, width if width > 1 else 8
    if len(data) < width:
        return 0, len(data)
    return int(rng.integers(0, len(data) // width)) * width, width


def _json_paths(value: Any, path: tuple = ()) -> list[tuple]:
    paths = [path]
    if isinstance(value, dict):
        for key, item in value.items():
            paths += _json_paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            paths += _json_paths(item, (*path, index))
    return paths


def mutate(files: dict[str, bytes], twin: dict[str, bytes], seed: int, case: int,
           roles: tuple[str, ...] = ROLES) -> tuple[dict[str, bytes], dict]:
    """The files of case ``case`` and a description of the edit (what a reproducer records); the file edited is
    one of ``roles`` (but a stale or re-signed metadata file)."""
    from mmidx import format as fmt

    rng = np.random.default_rng([seed, case])
    files = dict(files)
    role = str(rng.choice(sorted(set(files) & set(roles))))
    data = bytearray(files[role])
    kind = str(rng.choice(["flip", "flip", "boundary", "boundary", "boundary", "truncate", "extend", "swap",
                           "stale_meta", "delete", "json"]))
    if kind == "json" and role not in ("meta", "enc.json"):
        kind = "boundary"
    resign = kind != "stale_meta" and bool(rng.random() < 0.35)
    edit: dict[str, Any] = {"case": case, "role": role, "kind": kind, "resigned": resign}
    if kind == "flip":
        edits = []
        for _ in range(int(rng.integers(1, 4))):
            if not data:
                break
            offset = int(rng.integers(len(data)))
            data[offset] ^= int(rng.integers(1, 256))
            edits.append([offset, data[offset:offset + 1].hex()])
        edit["writes"] = edits
    elif kind == "boundary":
        offset, width = _words(role, bytes(data), rng)
        value = int(rng.choice(BOUNDARY)) if rng.random() < 0.8 else len(data) + int(rng.integers(-2, 3))
        word = (value % (1 << (8 * width))).to_bytes(width, "little")[: len(data) - offset]
        data[offset:offset + len(word)] = word
        edit["writes"] = [[offset, word.hex()]]
    elif kind == "truncate":
        size = int(rng.integers(0, max(len(data), 1)))
        del data[size:]
        edit["size"] = size
    elif kind == "extend":
        extra = bytes(int(rng.integers(1, 65))) if rng.random() < 0.5 else rng.bytes(int(rng.integers(1, 65)))
        data += extra
        edit["appended"] = extra.hex()
    elif kind == "swap":
        role = edit["role"] = str(rng.choice(sorted(set(files) & set(twin) & set(roles))))
        data = bytearray(twin[role])
    elif kind == "stale_meta":
        role = edit["role"] = "meta"
        data = bytearray(twin.get("meta", b""))
    elif kind == "delete":
        data = None
    else:  # a JSON field replaced by a value of another type or range
        meta = json.loads(data)
        paths = [path for path in _json_paths(meta) if path and path[0] != "meta_sha256"]
        path = paths[int(rng.integers(len(paths)))]
        value = JSON_VALUES[int(rng.integers(len(JSON_VALUES)))]
        target = meta
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        edit["json"] = [list(path), value]
        data = bytearray(fmt.serialize_metadata(meta) if resign else json.dumps(meta, indent=1).encode())
        resign = False
    if data is None:
        del files[role]
    else:
        files[role] = bytes(data)
    if resign and role.startswith("enc.") and "enc.json" in files:
        try:
            meta = json.loads(files["enc.json"])
            for file_role, entry in meta["files"].items():
                content = files.get(f"enc.{file_role}", b"")
                digest = fmt.FILE_HASHES[fmt.FILE_HASH](content).hexdigest()
                entry.update({"bytes": len(content), fmt.FILE_HASH: digest})
            files["enc.json"] = fmt.serialize_metadata(meta)
        except (ValueError, KeyError, TypeError, AttributeError):
            edit["resigned"] = False
    elif resign and "meta" in files:
        try:
            meta = json.loads(files["meta"])
            for file_role, entry in meta["files"].items():  # each checksum under the algorithm it names
                content = files.get(file_role, b"")
                algorithm = fmt.file_hash_algorithm(entry)
                entry.update({"bytes": len(content), algorithm: fmt.FILE_HASHES[algorithm](content).hexdigest()})
            files["meta"] = fmt.serialize_metadata(meta)
        except (ValueError, KeyError, TypeError, AttributeError, StopIteration):  # StopIteration: no checksum left
            edit["resigned"] = False
    return files, edit


def write_files(prefix: Path, files: dict[str, bytes]) -> None:
    for role in ROLES:
        path = role_path(prefix, role)
        if role in files:
            path.write_bytes(files[role])
        elif path.exists():
            path.unlink()


# --------------------------------------------------------------------------- reading everything


def read_everything(prefix: Path) -> str:
    """A digest of everything a training job reads from the dataset at ``prefix``."""
    import torch

    from mmidx.config import DataConfig
    from mmidx.index.pack_index import build_pack_index
    from mmidx.pack import masks
    from mmidx.pack.builder import PackBuilder
    from mmidx.read.dataset import MMIDXDataset
    from mmidx.train.gpt import GPTTextDataset

    digest = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype.str}{value.shape}".encode() + np.ascontiguousarray(value).tobytes())
        elif isinstance(value, (bytes, memoryview)):
            digest.update(bytes(value))
        else:
            digest.update(json.dumps(value, sort_keys=True, default=str).encode())

    dataset = MMIDXDataset(prefix)
    add([dataset.kind, len(dataset), dataset.special_tokens])
    for index in range(len(dataset)):
        sample = dataset[index]
        for text in sample.texts:
            add(text)
        for image in sample.images:
            add(image.data)
            add(list(image[1:]))
        for view in range(sample.num_views):
            add(sample.elements(view))
            add(sample.sequence_plan(view))
        add([sample.extra, sample.origin])
    tokens, bounds = dataset.gather(np.arange(dataset.tokens.sequence_count))
    add(tokens)
    add(bounds)
    gpt = GPTTextDataset(dataset, seq_length=8, num_samples=6)
    for index in range(len(gpt)):
        for value in gpt[index].values():
            add(value)
    group: dict[str, Any] = {"datasets": [str(prefix)], "is_mandatory": True}
    if dataset.plan is not None:
        group.update(image_transform_args=VAE, vit_image_transform_args=VIT)
    config = DataConfig.from_dict({"groups": {"g": group}, "geometry": GEOMETRY, "packing": PACKING,
                                   "dropout": {"text": 0.0, "vit": 0.0, "vae": 0.0}})
    index = build_pack_index(config, num_samples=2 * len(dataset), cache_dir=None)
    for name in sorted(index.arrays):  # pack_offsets, samples and (with several views) views
        add(index.arrays[name])
    encoded = any(role_path(prefix, role).exists() for role in ROLES if role.startswith("enc."))
    if encoded:
        for number in range(len(dataset)):
            sample = dataset[number]
            add([sample.encoding(ENCODING, j) for j in range(sample.num_images)])
    # the ids the dataset records, as a job takes them; a dataset that records none (a bare Megatron pair) is given them
    special = None if dataset.special_tokens else SPECIAL
    for decode_images in ("loader", "device", *(("latents",) if encoded else ())):
        builder = PackBuilder(config, use_flex=False, decode_images="device" if decode_images == "device" else "loader",
                              datasets=[[dataset]], special_tokens=special,
                              encodings={"vae": ENCODING} if decode_images == "latents" else None)
        # every pack with the loader's decode: "verify --decode passed" must mean "every pack builds"
        for pack in range(len(index) if decode_images == "loader" else min(len(index), 2)):
            batch = builder.build(pack, index.items(pack)).to("cpu")
            for _key, value in sorted(batch.to_dict().items()):  # with the dense masks
                add([add(v) for v in value] if isinstance(value, list) and value
                    and isinstance(value[0], torch.Tensor) else value)
            flex = masks.block_mask(*batch.flat_split_metadata(pad=True), device="cpu")
            add([flex.kv_num_blocks, flex.kv_indices, flex.full_kv_num_blocks, flex.full_kv_indices])
    return digest.hexdigest()


def _names_the_files(error: BaseException, prefix: Path) -> bool:
    return str(prefix) in str(error)


def run_case(prefix: Path, files: dict[str, bytes], edit: dict, reference: str) -> dict:
    """Outcome of one mutated dataset (in the worker process)."""
    from mmidx.format import FormatError
    from mmidx.read.checks import verify

    write_files(prefix, files)
    result: dict[str, Any] = {"case": edit["case"]}
    try:
        digest = read_everything(prefix)
    except (FormatError, IndexError, ValueError) as error:
        digest = None
        if not _names_the_files(error, prefix):
            result.update(outcome="other exception", error=f"{type(error).__name__}: {error}",
                          trace=traceback.format_exc(limit=-4))
            return result
        result.update(outcome="clean error", error=f"{type(error).__name__}: {error}",
                      trace=traceback.format_exc(limit=-4))
    except Exception as error:  # the point of the fuzzer: anything else is a finding
        result.update(outcome="other exception", error=f"{type(error).__name__}: {error}",
                      trace=traceback.format_exc(limit=-4))
        return result
    try:
        problems = verify(prefix, decode=True)
    except Exception as error:
        result.update(outcome="other exception", error=f"verify: {type(error).__name__}: {error}",
                      trace=traceback.format_exc(limit=-4))
        return result
    if digest is None:
        if not problems and edit["role"] == "enc.json" and edit["resigned"] and "cannot serve as" in result["error"]:
            # a re-signed stream JSON recording another (valid) transform or encoder: the packer refuses it for this
            # config's group, rightly; verify checks a dataset, not whether a stream fits some config
            result["outcome"] = "different, unguarded"
        elif not problems:  # verify OK must mean every sample reads and every pack builds
            result["outcome"] = "verify passed, read failed"
        else:
            del result["error"], result["trace"]
        return result
    if digest == reference:
        result["outcome"] = "identical"
    elif problems:
        result["outcome"] = "different, caught by verify"
    elif edit["resigned"] or edit["kind"] == "json" or "meta" not in files:
        result["outcome"] = "different, unguarded"  # checksums recomputed, or a bare Megatron pair
    else:
        result["outcome"] = "different and missed"
    return result


# --------------------------------------------------------------------------- worker and pool


class Bases:
    """The base datasets and their twins, their files, and the reference digest of each; the cases mutate the
    bases of ``kinds`` (in turn) in their files of ``roles`` (a campaign focused on some files)."""

    def __init__(self, folder: Path, kinds: tuple[str, ...] = KINDS, roles: tuple[str, ...] = ROLES):
        self.folder = folder
        self.files = {kind: files_of(folder / f"{kind}-0") for kind in KINDS}
        self.twins = {kind: files_of(folder / f"{kind}-1") for kind in KINDS}
        self.references: dict[str, str] = {}
        self.kinds, self.roles = kinds, roles
        for kind in kinds:
            if not set(self.files[kind]) & set(self.twins[kind]) & set(roles):
                raise SystemExit(f"fuzz.py: the {kind} dataset has no file of the roles {', '.join(roles)}")

    def reference(self, kind: str, prefix: Path) -> str:
        """What reading the unmutated dataset at ``prefix`` (where the cases are written) gives."""
        if kind not in self.references:
            write_files(prefix, self.files[kind])
            self.references[kind] = read_everything(prefix)
        return self.references[kind]

    def case(self, seed: int, case: int) -> tuple[str, dict[str, bytes], dict]:
        kind = self.kinds[case % len(self.kinds)]
        files, edit = mutate(self.files[kind], self.twins[kind], seed, case, self.roles)
        edit["dataset"] = kind
        return kind, files, edit


def worker(bases: Bases, seed: int) -> None:
    """Read case numbers from stdin, answer one JSON outcome per line on stdout."""
    scratch = Path(tempfile.mkdtemp(prefix="fuzz-worker-"))
    try:
        for line in sys.stdin:
            case = int(line)
            if str(case) == os.environ.get("MMIDX_FUZZ_ABORT_CASE"):  # lets the tests see a crash observed
                os.abort()
            kind, files, edit = bases.case(seed, case)
            prefix = scratch / f"case-{kind}"
            result = run_case(prefix, files, edit, bases.reference(kind, prefix))
            result["edit"] = edit
            sys.stdout.write(json.dumps(result, default=str) + "\n")
            sys.stdout.flush()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class Worker:
    def __init__(self, bases: Bases, seed: int):
        env = {**os.environ, "PYTHONFAULTHANDLER": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--worker", str(bases.folder), "--seed", str(seed), "--kinds",
             ",".join(bases.kinds), "--roles", ",".join(bases.roles)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
            bufsize=1)
        self.case: int | None = None
        self.started = 0.0

    def send(self, case: int) -> None:
        self.case, self.started = case, time.monotonic()
        self.process.stdin.write(f"{case}\n")
        self.process.stdin.flush()

    def stop(self) -> str:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        return self.process.stderr.read()[-4000:]


def _crashes(prefix: Path, timeout: float) -> bool:
    """Whether reading the dataset at ``prefix`` kills (or hangs) a fresh process."""
    try:
        run = subprocess.run([sys.executable, __file__, "--replay", str(prefix)], capture_output=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        return True
    return run.returncode < 0


def reproduce(bases: Bases, seed: int, case: int, out: Path, reason: str, stderr: str, timeout: float) -> Path:
    """Write the mutated files of a crashing or hanging case, reduced to a single write when one of
    its writes alone still crashes: the reproducer is then one file, one offset and its bytes."""
    kind, files, edit = bases.case(seed, case)
    folder = out / f"repro-{case}"
    folder.mkdir(parents=True, exist_ok=True)
    for offset, data in edit.get("writes", []) if len(edit.get("writes", [])) > 1 else []:
        single = dict(bases.files[kind])
        content = bytearray(single[edit["role"]])
        content[offset:offset + len(data) // 2] = bytes.fromhex(data)
        single[edit["role"]] = bytes(content)
        write_files(folder / kind, single)
        if _crashes(folder / kind, timeout):
            files, edit = single, {**edit, "writes": [[offset, data]], "reduced": True}
            break
    write_files(folder / kind, files)
    (folder / "edit.json").write_text(json.dumps({"reason": reason, "edit": edit, "stderr": stderr}, indent=1,
                                                 default=str))
    (folder / "README").write_text(
        f"{reason} of case {case}: {edit}\nRun: python tools/fuzz.py --replay {folder / kind}\n")
    return folder


def run_pool(bases: Bases, seed: int, cases: range, jobs: int, case_timeout: float, time_limit: float | None,
             out: Path, progress: int = 0) -> tuple[collections.Counter, list[dict]]:
    counts: collections.Counter = collections.Counter()
    findings: list[dict] = []
    pending = iter(cases)
    selector = selectors.DefaultSelector()
    workers: list[Worker] = []
    deadline = None if time_limit is None else time.monotonic() + time_limit
    exhausted = False

    def start() -> Worker:
        worker = Worker(bases, seed)
        workers.append(worker)
        selector.register(worker.process.stdout, selectors.EVENT_READ, worker)
        return worker

    def feed(worker: Worker) -> None:
        nonlocal exhausted
        if exhausted or (deadline is not None and time.monotonic() > deadline):
            exhausted = True
            worker.case = None
            return
        case = next(pending, None)
        if case is None:
            exhausted = True
            worker.case = None
            return
        worker.send(case)

    def replace(worker: Worker, outcome: str) -> None:
        stderr = worker.stop()
        selector.unregister(worker.process.stdout)
        workers.remove(worker)
        counts[outcome] += 1
        folder = reproduce(bases, seed, worker.case, out, outcome, stderr, case_timeout)
        findings.append({"case": worker.case, "outcome": outcome, "reproducer": str(folder), "stderr": stderr[-800:]})
        feed(start())

    for _ in range(jobs):
        feed(start())
    while any(worker.case is not None for worker in workers):
        for key, _ in selector.select(timeout=1.0):
            worker = key.data
            line = worker.process.stdout.readline()
            if not line:
                replace(worker, "crash")
                continue
            result = json.loads(line)
            counts[result["outcome"]] += 1
            if result["outcome"] in BAD_OUTCOMES:
                findings.append(result)
                print(f"finding: {json.dumps(result, default=str)[:1500]}", file=sys.stderr, flush=True)
            if progress and sum(counts.values()) % progress == 0:
                print(f"{sum(counts.values()):,} cases: {dict(counts)}", file=sys.stderr, flush=True)
            feed(worker)
        now = time.monotonic()
        for worker in list(workers):
            if worker.case is not None and now - worker.started > case_timeout:
                replace(worker, "hang")
    for worker in workers:
        worker.process.stdin.close()
        worker.stop()
    return counts, findings


def table(counts: collections.Counter, seconds: float) -> str:
    total = sum(counts.values())
    lines = [f"{total:,} mutated datasets in {seconds:.0f} s", "", "| outcome | cases |", "|---|---:|"]
    lines += [f"| {outcome} | {counts.get(outcome, 0):,} |" for outcome in OUTCOMES]
    return "\n".join(lines)


def _names(known: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(name for name in text.split(",") if name)
        if not names or set(names) - set(known):
            raise argparse.ArgumentTypeError(f"{text!r}: give some of {', '.join(known)}")
        return names
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2000, help="number of mutated datasets")
    parser.add_argument("--first", type=int, default=0, help="number of the first case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the mutations")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--case-timeout", type=float, default=60.0, help="seconds before a case counts as a hang")
    parser.add_argument("--time-limit", type=float, help="stop starting cases after this many seconds")
    parser.add_argument("--out", default="fuzz-out", help="folder for the base datasets and reproducers")
    parser.add_argument("--json", action="store_true", help="print the counts and findings as JSON")
    parser.add_argument("--progress", type=int, default=0, help="print the counts to stderr every N cases")
    parser.add_argument("--kinds", type=_names(KINDS), default=KINDS,
                        help="comma-separated kinds of dataset to mutate, in turn (default: all)")
    parser.add_argument("--roles", type=_names(ROLES), default=ROLES,
                        help="comma-separated files to mutate, e.g. images (default: all)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--replay", help="read a reproducer's dataset prefix in this process")
    args = parser.parse_args(argv)
    if args.worker:
        worker(Bases(Path(args.worker), args.kinds, args.roles), args.seed)
        return 0
    if args.replay:
        print(read_everything(Path(args.replay)))
        return 0
    out = Path(args.out)
    bases_dir = out / "bases"
    if not (bases_dir / "done").exists():
        shutil.rmtree(bases_dir, ignore_errors=True)
        bases_dir.mkdir(parents=True)
        for kind in KINDS:
            for twin in (0, 1):
                build_base(bases_dir, kind, twin)
        (bases_dir / "done").touch()
    bases = Bases(bases_dir, args.kinds, args.roles)
    start = time.monotonic()
    counts, findings = run_pool(bases, args.seed, range(args.first, args.first + args.cases), args.jobs,
                                args.case_timeout, args.time_limit, out, args.progress)
    seconds = time.monotonic() - start
    if args.json:
        print(json.dumps({"counts": dict(counts), "findings": findings, "seconds": seconds}, default=str))
    else:
        print(table(counts, seconds))
        for finding in findings[:20]:
            print(json.dumps(finding, default=str)[:1500])
    return 1 if any(counts.get(outcome) for outcome in BAD_OUTCOMES) else 0


if __name__ == "__main__":
    sys.exit(main())
