"""``prompts``: prompt files for RL rollouts, with UniRL's contract (``unirl/data/datasets.py``, seed 003).

Files, by extension (any other is refused):

* ``.txt``: one prompt per non-empty line (surrounding whitespace removed) → ``{"prompt": line}``;
* ``.jsonl``: one JSON value per non-empty line;
* ``.json``: a list of strings or objects, or an object with a ``prompts`` list, or one prompt object.

Each entry (a string is ``{"prompt": string}``), numbered from 0 in its file:

* ``prompt`` (the ``--prompt-key``), or else ``caption``, is required and non-empty, else the entry
  is skipped (``empty_text``);
* ``prompt_id`` defaults to ``{file name}:{index}``;
* ``metadata`` is kept as given; without it, every key other than the prompt key, ``prompt``,
  ``caption``, ``media``, ``media_refs``, ``metadata`` and ``prompt_id`` is folded into it;
* ``media_refs`` (or ``media``): ``[{modality, role, uri}]``; relative URIs resolve against the
  file's folder, absolute paths and URIs pass through. Each ``image``/``condition`` ref is loaded and
  stored as an image; other modality/role pairs skip the entry. ``http(s)://`` URIs are downloaded
  through mmidx's fetcher (:mod:`mmidx.fetch.client`, the fetch options of ``mmidx build``), and a
  failed download skips the entry with its class (``fetch:not_found``, ``fetch:timeout``...);
* legacy precomputed-embedding fields (any key containing ``embed``, e.g. ``prompt_embed_path``,
  ``prompt_embeds``) stop the build with an error: embeddings are computed at run time.

Stored per prompt: ``extra = {prompt, prompt_id, metadata, media_refs}`` (URIs resolved), the
prompt's tokens, the condition images, and one view: for each condition image a clean
vae_image + vit_image (loss 0, enable_cfg 1, as BAGEL conditions an edit on its source image),
then text(prompt, loss 0, enable_cfg 1).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterator, Sequence
from contextlib import closing
from typing import Any

from mmidx.sources import Skip, Skipped, SourceContext, SourceError, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import TextTable, assemble, samples_of
from mmidx.sources.elements import Element
from mmidx.sources.inputs import file_identity, list_inputs, parent, read_bytes, read_jsonl, read_lines, resolve
from mmidx.sources.media import ingest_image_file
from mmidx.sources.urls import Downloads

KIND = "multimodal"
EXTENSIONS = (".txt", ".jsonl", ".json")
RESERVED_KEYS = ("prompt", "caption", "media", "media_refs", "metadata", "prompt_id")


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """One unit per prompt file; files with other extensions are refused."""
    paths = list_inputs(inputs, EXTENSIONS)
    for path in paths:
        if not path.endswith(EXTENSIONS):
            raise SourceError(f"{path}: prompt files must end in .txt, .jsonl or .json")
    return [WorkUnit(path, identity=file_identity(path)) for path in paths]


def _entries(unit: WorkUnit) -> Iterator[tuple[int, Any] | Skip]:
    """(index, entry) of every prompt entry of the file, in order; unparsable lines or files as Skips."""
    if unit.path.endswith(".txt"):
        lines = (line.decode("utf-8", errors="replace").strip() for _, line in read_lines(unit))
        yield from enumerate(line for line in lines if line)
    elif unit.path.endswith(".jsonl"):
        for index, item in enumerate(read_jsonl(unit)):
            yield Skip(index, item.reason, item.detail) if isinstance(item, Skip) else (index, item[1])
    else:
        try:
            document = json.loads(read_bytes(unit.path))
        except ValueError as error:
            yield Skip(-1, "invalid_json", str(error))
            return
        if isinstance(document, dict):
            document = document["prompts"] if isinstance(document.get("prompts"), list) else [document]
        if not isinstance(document, list):
            yield Skip(-1, "malformed_record", "a .json prompt file holds a list, or an object with a prompts list")
            return
        yield from enumerate(document)


def _media_refs(entry: dict, folder: str) -> list[dict]:
    refs = entry.get("media_refs", entry.get("media")) or []
    if not isinstance(refs, list) or not all(isinstance(ref, dict) and isinstance(ref.get("uri"), str)
                                             for ref in refs):
        raise Skipped("malformed_record", "media_refs is not a list of {modality, role, uri}")
    resolved = []
    for ref in refs:
        if (ref.get("modality"), ref.get("role")) != ("image", "condition"):
            raise Skipped("malformed_record", f"media ref {ref.get('modality')}/{ref.get('role')} is not "
                                              "supported; only image/condition refs are")
        resolved.append({**ref, "uri": resolve(folder, ref["uri"])})
    return resolved


def _sample(unit: WorkUnit, index: int, entry: Any, context: SourceContext, downloads: Downloads) -> SourceSample:
    if isinstance(entry, str):
        entry = {"prompt": entry}
    if not isinstance(entry, dict):
        raise Skipped("malformed_record", f"a prompt entry is a string or an object, not {type(entry).__name__}")
    legacy = sorted(key for key in entry if "embed" in key)
    if legacy:
        raise SourceError(f"{unit.path}: entry {index} has precomputed-embedding fields {legacy}; they are no "
                          "longer accepted (embeddings are computed at run time): remove them from the file")
    key = context.options.prompt_key
    prompt = entry.get(key, entry.get("caption"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise Skipped("empty_text", f"no non-empty {key!r} or 'caption'")
    refs = _media_refs(entry, parent(unit.path))
    reserved = (*RESERVED_KEYS, key)
    metadata = entry["metadata"] if "metadata" in entry else {k: v for k, v in entry.items() if k not in reserved}
    prompt_id = entry.get("prompt_id", f"{posixpath.basename(unit.path)}:{index}")
    table = TextTable()
    view = [element for j in range(len(refs)) for element in
            (Element("vae_image", j, enable_cfg=True), Element("vit_image", j, enable_cfg=True))]
    view.append(Element("text", table.add(prompt), enable_cfg=True))
    extra = {"prompt": prompt, "prompt_id": prompt_id, "metadata": metadata, "media_refs": refs}

    def load(j: int) -> Any:
        uri = refs[j]["uri"]
        return downloads.image(uri) if uri.startswith(("http://", "https://")) else ingest_image_file(uri, context)

    return assemble(index, [view], table.encode(context), load, extra)


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per prompt entry."""
    with closing(Downloads(context)) as downloads:
        yield from samples_of(_entries(unit), lambda index, entry: _sample(unit, index, entry, context, downloads))
