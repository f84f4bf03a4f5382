"""``wds``: image-caption pairs in WebDataset tar shards (LAION-style t2i data, seed 004), built like ``t2i``.

A sample is the run of consecutive tar members sharing a key — the member's path up to the first
dot of its file name, WebDataset's rule (``a/00042.jpg`` and ``a/00042.txt`` are sample
``a/00042``); members without a dot in their name are ignored. Per sample:

* the image is the first member whose extension is one of ``IMAGE_EXTENSIONS``; a sample without
  one is skipped (``missing_file``);
* captions are the ``.txt`` member (UTF-8, stripped) and/or the ``--caption-key`` field (default
  ``caption``) of the ``.json`` member; a sample with neither is skipped (``bad_captions``), a
  ``.json`` that does not parse is skipped (``invalid_json``); empty captions are dropped, and no
  caption left gives BAGEL's single caption " " (as for an empty ``captions`` object in ``t2i``);
* then exactly ``t2i``'s rules: every distinct caption stored once, K views covering the captions
  before repeating, each text(caption, enable_cfg=1) → vae_image(loss=1).

Rows are numbered by sample order in the tar, from 0. A tar that ends early (truncated, corrupt)
keeps the samples before the damage and reports the file as ``unreadable_file``.
"""

from __future__ import annotations

import json
import re
import tarfile
from collections.abc import Iterator, Sequence

from mmidx.sources import Skip, Skipped, SourceContext, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import caption_sample
from mmidx.sources.inputs import file_identity, filesystem, list_inputs
from mmidx.sources.media import ingest_image

KIND = "multimodal"
EXTENSIONS = (".tar", ".tar.gz", ".tgz")
IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "bmp", "gif", "tif", "tiff")
_KEY_AND_EXTENSION = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """One unit per tar shard."""
    return [WorkUnit(path, identity=file_identity(path)) for path in list_inputs(inputs, EXTENSIONS)]


def _groups(unit: WorkUnit) -> Iterator[dict[str, bytes] | Skip]:
    """The members of each sample, ``{extension: content}``, in tar order; a read failure as a Skip."""
    fs, path = filesystem(unit.path)
    key, members = None, {}
    try:
        with fs.open_input_stream(path) as stream, tarfile.open(fileobj=stream, mode="r|*") as archive:
            for member in archive:
                match = _KEY_AND_EXTENSION.match(member.name)
                if not member.isfile() or match is None:
                    continue
                if match.group(1) != key and members:
                    yield members
                    members = {}
                key = match.group(1)
                members[match.group(2).lower()] = archive.extractfile(member).read()
    except (tarfile.TarError, OSError, EOFError) as error:
        if members:
            yield members
        yield Skip(-1, "unreadable_file", f"tar ended early: {error}")
        return
    if members:
        yield members


def _captions(members: dict[str, bytes], caption_key: str) -> list[str]:
    captions = []
    if "txt" in members:
        captions.append(members["txt"].decode("utf-8", errors="replace").strip())
    if "json" in members:
        try:
            record = json.loads(members["json"])
        except ValueError as error:
            raise Skipped("invalid_json", f".json member: {error}") from error
        if isinstance(record, dict) and isinstance(record.get(caption_key), str):
            captions.append(record[caption_key].strip())
    if not captions:
        raise Skipped("bad_captions", f"no .txt member and no {caption_key!r} in a .json member")
    return [caption for caption in captions if caption]


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per key."""
    row = 0
    for members in _groups(unit):
        if isinstance(members, Skip):
            yield Skip(row, members.reason, members.detail)
            continue
        try:
            extension = next((e for e in IMAGE_EXTENSIONS if e in members), None)
            if extension is None:
                raise Skipped("missing_file", f"sample has no image member (members: {sorted(members)})")
            image = ingest_image(members[extension], context)
            captions = _captions(members, context.options.caption_key)
            yield caption_sample(row, captions, image, context.rng(unit.path, row), context)
        except Skipped as skipped:
            yield skipped.at(row)
        row += 1
