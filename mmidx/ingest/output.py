"""Whether a build or merge may write its output: the report beside a dataset says whose result it is.

``mmidx build``, ``mmidx merge`` and ``mmidx.write`` ask :func:`claim_output` before they write anything at
``OUTPUT``. What is there decides:

* nothing (no ``OUTPUT.idx`` or ``OUTPUT.meta.json``): written;
* this command's finished result — the report ``OUTPUT.report.json`` has the same key (the inputs and
  options: a build's plan key, or the merged datasets and their checksums) and describes the dataset there
  (its metadata checksum): reused, nothing is written ("already built");
* another command's result — a report with another key describes it: replaced only with ``force``
  (``--force``);
* a dataset no report describes: if its metadata records this very command (the same build
  configuration, or the same merged datasets) it is what a run killed between writing the dataset and its
  report left, and is written again; any other (a ``DatasetBuilder``'s, a Megatron pair, one whose report
  was deleted) is replaced only with ``force``.

A dataset being replaced loses its report first (``mmidx.ingest.writer`` removes it as it commits the new
files), so no report ever describes other data.
"""

from __future__ import annotations

from typing import Any

from mmidx import format as fmt
from mmidx.errors import option
from mmidx.ingest.plan import BuildError, meta_sha256
from mmidx.io.files import read_json


def claim_output(output: str, key: str, recorded: dict[str, Any], *, force: bool,
                 command: str) -> dict[str, Any] | None:
    """The report of ``output`` when the dataset there is already this command's finished result (``key``), else
    None: the command may write ``output``. ``recorded`` is what the command's dataset records in its metadata
    (``{"build": config}``...), which identifies a dataset of this command whose report a kill prevented.

    Raises :class:`BuildError` when ``output`` holds any other dataset and not ``force``.
    """
    previous = read_json(fmt.report_path(output))
    checksum = (previous or {}).get("meta_sha256")
    described = checksum is not None and checksum == meta_sha256(output)
    if described and previous.get("key") == key:
        return previous
    if force or not fmt.holds_dataset(output):
        return None
    if described:
        why = f"{output} holds a dataset built from other inputs or options (see {fmt.report_path(output)})"
    else:
        meta = read_json(fmt.file_path(output, "meta")) or {}
        if all(fmt.canonical_json(meta.get(name)) == fmt.canonical_json(value) for name, value in recorded.items()):
            return None  # this command's own result, written before a kill stopped it writing the report
        why = f"{output} holds a dataset that is not the result of this {command} (no report beside it says so)"
    raise BuildError(f"{why}; pass {option('force', True)} to replace it, or choose another output")
