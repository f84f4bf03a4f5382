"""``urls``: image–text pairs given by URL tables (LAION, DataComp, COYO), downloaded while building.

Input: tables (:mod:`mmidx.sources.tables`: parquet, CSV/TSV, JSONL, optionally ``.gz``) with a URL column
(``--url-column``, LAION's ``URL``) and a caption column (``--caption-column``, LAION's ``TEXT``). Each
row whose image downloads (:mod:`mmidx.fetch.client`) becomes a t2i sample exactly as the ``t2i`` source
builds it from the same bytes (:func:`mmidx.sources.t2i` rules, same helpers): the image passes
:func:`mmidx.sources.media.ingest_image` (header probed, pixel limit applied before any decode, then
decoded once as a check) and is stored as served, unless ``--max-image-size`` asks for a downscale; a
caption cell is either BAGEL's JSON object of captions or a plain string (one caption). Columns named by
``--keep-columns`` are stored as the sample's extra data, beside its origin (table, row).

Every other row is a counted skip: ``bad_captions`` (checked before anything is fetched) or
``fetch:<class>`` (:mod:`mmidx.fetch.outcomes`), and every row gets a line in the unit's fetch ledger
(:mod:`mmidx.fetch.ledger`). Fetches run concurrently on the unit's own fetcher, but rows are taken in
input order from a bounded window, so the files do not depend on concurrency, latency or which fetch
ends first, and memory is bounded by the fetches in flight, not by the table.

With ``retry_failed`` (the prefix of an earlier build of the same tables), a row the earlier ledger says
was stored is taken from the earlier dataset's bytes, a row that failed for good is skipped with its
earlier class, and only rows that failed transiently (timeout, connection, dns, 429/5xx) are fetched again.
"""

from __future__ import annotations

import functools
import json
import os
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mmidx.fetch.ledger import LedgerWriter, ledger_path, read_ledger
from mmidx.fetch.outcomes import OK, OPT_OUT_IGNORED, is_transient, skip_reason
from mmidx.sources import Skip, Skipped, SourceContext, SourceError, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.common import caption_sample
from mmidx.sources.elements import StoredImage
from mmidx.sources.inputs import file_identity, list_inputs
from mmidx.sources.media import ingest_image
from mmidx.sources.t2i import parse_captions
from mmidx.sources.tables import TABLE_EXTENSIONS, read_table, table_units

KIND = "multimodal"
EXTENSIONS = TABLE_EXTENSIONS
MAX_SKIP_RATE = 1.0  # downloads fail as a matter of course: the user sets the limit (the summary warns past 20%)
WINDOW_PER_FETCH = 32  # rows read ahead per concurrent fetch, so a slow row holds up few others ...
WINDOW_BYTES = 256 << 20  # ... while the bodies fetched ahead of the row being built stay under this
_INGEST_CLASSES = {"undecodable_image": "decode_error", "decompression_bomb": "too_large"}


def caption_column(options: SourceOptions) -> str:
    """The one caption column of a URL table (``--caption-column``; default ``caption``)."""
    if len(options.caption_columns) > 1:
        raise SourceError(f"--source urls takes one --caption-column, not {','.join(options.caption_columns)} "
                          "(a cell may hold BAGEL's JSON object of captions)")
    return options.caption_columns[0] if options.caption_columns else "caption"


def fetch_settings(options: SourceOptions) -> Any:
    """The :class:`mmidx.fetch.client.FetchSettings` of a build's options (imports aiohttp)."""
    from mmidx.fetch.client import FetchSettings

    return FetchSettings(concurrency=options.fetch_concurrency, per_host=options.per_host,
                         timeout=options.fetch_timeout, max_bytes=options.max_image_bytes,
                         retries=options.fetch_retries, respect_opt_out=not options.ignore_opt_out,
                         user_agent_token=options.user_agent_token,
                         hosts=dict(entry.split("=", 1) for entry in options.resolve))


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Row ranges of the URL tables (checks first that aiohttp is installed and a retried build exists)."""
    try:
        fetch_settings(options)
    except ImportError as error:
        raise SourceError(str(error)) from error
    if options.retry_failed is not None and not ledger_path(options.retry_failed).exists():
        raise SourceError(f"--retry-failed: {ledger_path(options.retry_failed)} does not exist; it is written by a "
                          "build of --source urls, run one first")
    units = table_units(list_inputs(inputs, EXTENSIONS), options.rows_per_shard)
    if options.retry_failed is None:
        return units
    earlier = file_identity(os.fspath(ledger_path(options.retry_failed)))  # a later retry is another build
    return [replace(unit, identity=f"{unit.identity} retrying:{earlier}") for unit in units]


def captions_of(value: object) -> list[str]:
    """A caption cell's captions: BAGEL's JSON object of strings, or a plain string as the one caption."""
    if not isinstance(value, str):
        raise Skipped("bad_captions", f"caption is {type(value).__name__}, not a string")
    if not value.lstrip().startswith("{"):
        return [value]
    try:
        return parse_captions(value)
    except Skipped:
        return [value]


def ingest_fetched(body: bytes, context: SourceContext) -> StoredImage:
    """:func:`ingest_image` of downloaded bytes; a refused image is skipped as ``fetch:decode_error`` or
    ``fetch:too_large`` (pixels above the limit, read from the header before any decode)."""
    try:
        return ingest_image(body, context)
    except Skipped as skipped:
        raise Skipped(skip_reason(_INGEST_CLASSES.get(skipped.reason, "decode_error")), skipped.detail) from skipped


def failure(result: Any) -> Skipped:
    """The skip of a :class:`mmidx.fetch.client.FetchResult` that did not succeed."""
    return Skipped(skip_reason(result.outcome), f"{result.url[:300]}: {result.detail}")


class Downloads:
    """Single images fetched on demand through one fetcher, opened on first use (``prompts``' http(s) refs).

    Use with ``contextlib.closing``; a failed download raises ``Skipped("fetch:<class>")``.
    """

    def __init__(self, context: SourceContext):
        self.context = context
        self._pool: Any = None

    def image(self, url: str) -> StoredImage:
        if self._pool is None:
            from mmidx.fetch.client import FetchPool

            self._pool = FetchPool(fetch_settings(self.context.options)).__enter__()
        with self.context.timed("download wait"):
            result = self._pool.submit(url).result()
        if result.outcome != OK:
            raise failure(result)
        try:
            return ingest_fetched(result.body, self.context)
        except Skipped as skipped:
            raise Skipped(skipped.reason, f"{url[:300]}: {skipped.detail}") from skipped

    def close(self) -> None:
        if self._pool is not None:
            self._pool.__exit__(None, None, None)
            self._pool = None


@dataclass
class _Row:
    """A row on its way through the window: waiting for its fetch, or already decided."""

    row: int
    url: str | None = None
    captions: list[str] | None = None
    extra: dict[str, Any] | None = None
    fetch: Future | None = None
    skip: Skip | None = None
    reused: tuple[dict, bytes] | None = None  # (earlier ledger entry, stored bytes) of a row built before

    def ready(self) -> bool:
        return self.fetch is None or self.fetch.done()


class _Earlier:
    """An earlier build of the same table (``--retry-failed``): its ledger rows and stored images of one unit."""

    def __init__(self, prefix: str, unit: WorkUnit):
        from mmidx.read.dataset import MMIDXDataset

        stop = None if unit.rows is None else unit.first_row + unit.rows
        self.ledger = read_ledger(prefix, unit.path, unit.first_row, stop)
        self.samples: dict[int, int] = {}
        try:
            self.dataset = MMIDXDataset(prefix)
        except (OSError, ValueError):  # no samples were built (no dataset written): every row is in the ledger
            self.dataset = None
            return
        parts = self.dataset.parts
        for number, sources in _listed(self.dataset.prefix, self.dataset.checksum).get(unit.path, []):
            part = parts[number]
            origins = part.dataset.plan["sample_origin"]
            for first in range(0, len(origins), _ORIGINS):  # a chunk of origins at a time
                chunk = np.asarray(origins[first:first + _ORIGINS], dtype=np.int64)
                rows = chunk[:, 1]
                mine = np.flatnonzero(np.isin(chunk[:, 0], sources) & (rows >= unit.first_row)
                                      & (rows < (np.iinfo(np.int64).max if stop is None else stop)))
                self.samples.update(zip(rows[mine].tolist(), (mine + part.first_sample + first).tolist(), strict=True))

    def decide(self, row: int) -> tuple[dict, bytes | None] | None:
        """(ledger entry, stored bytes or None) when the row need not be fetched again, else None."""
        entry = self.ledger.get(row)
        if entry is None or is_transient(entry["class"], entry["status"]):
            return None
        if entry["class"] == OK:
            index = self.samples.get(row)
            return None if index is None else (entry, bytes(self.dataset[index].image(0).data))
        return entry, None


_ORIGINS = 1 << 20  # sample origins an earlier build's rows are looked up in at once


@functools.lru_cache(maxsize=2)
def _listed(prefix: str, checksum: str) -> dict[str, list[tuple[int, list[int]]]]:
    """Where each input file of the dataset at ``prefix`` (of metadata ``checksum``) is among its parts' sources: per
    file, (part, its numbers in that part's sources), each part's metadata read once per process (a sharded
    dataset lists a file split into units once in each unit's shard)."""
    from mmidx.read.dataset import MMIDXDataset

    listed: dict[str, list[tuple[int, list[int]]]] = {}
    for number, part in enumerate(MMIDXDataset(prefix).parts):
        found: dict[str, list[int]] = {}
        for place, name in enumerate((part.dataset.metadata or {}).get("sources", [])):
            found.setdefault(name, []).append(place)
        for name, places in found.items():
            listed.setdefault(name, []).append((number, places))
    return listed


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _start(item: tuple[int, dict] | Skip, options: SourceOptions, pool: Any, earlier: _Earlier | None) -> _Row:
    """Take a row into the window: check its captions, then reuse it or start its fetch."""
    if isinstance(item, Skip):
        return _Row(item.row, skip=item)
    row, record = item
    url = record[options.url_column]
    pending = _Row(row, url if isinstance(url, str) else None)
    try:
        pending.captions = captions_of(record[caption_column(options)])
    except Skipped as skipped:
        pending.skip = skipped.at(row)
        return pending
    pending.extra = {name: _jsonable(record[name]) for name in options.keep_columns} or None
    decided = earlier.decide(row) if earlier is not None else None
    if decided is not None:
        entry, stored = decided
        if stored is None:
            pending.skip = Skip(row, skip_reason(entry["class"]), entry["detail"])
        pending.reused = (entry, stored)
    elif pending.url is None:
        pending.skip = Skip(row, skip_reason("invalid_url"), f"URL cell is {type(url).__name__}, not a string")
    else:
        pending.fetch = pool.submit(pending.url)
    return pending


def _finish(unit: WorkUnit, pending: _Row, context: SourceContext, ledger: LedgerWriter) -> SourceSample | Skip:
    """The row's sample or skip, and its ledger line."""
    row, path = pending.row, unit.path
    if pending.reused is not None:
        entry, stored = pending.reused
        ledger.add(path, row, pending.url, entry["class"], entry["status"], entry["bytes"], entry["sha256"],
                   entry["attempts"], entry["detail"])
        if stored is None:
            return pending.skip
        return _sample(unit, pending, stored, False, context)
    if pending.skip is not None:
        outcome = pending.skip.reason.removeprefix("fetch:")
        ledger.add(path, row, pending.url, outcome, detail=pending.skip.detail)
        return pending.skip
    with context.timed("download wait"):
        result = pending.fetch.result()
    size = None if result.body is None else len(result.body)
    outcome, detail = result.outcome, result.detail
    try:
        if outcome != OK:
            raise failure(result)
        return _sample(unit, pending, result.body, result.opted_out, context)
    except Skipped as skipped:
        outcome, detail = skipped.reason.removeprefix("fetch:"), skipped.detail
        return skipped.at(row)
    finally:
        ledger.add(path, row, pending.url, outcome, result.status, size, result.sha256, result.attempts, detail)


def _sample(unit: WorkUnit, pending: _Row, body: bytes, opted_out: bool, context: SourceContext) -> SourceSample:
    image = ingest_fetched(body, context)
    sample = caption_sample(pending.row, pending.captions, image, context.rng(unit.path, pending.row), context)
    sample.extra = pending.extra
    if opted_out:
        sample.warnings.append((OPT_OUT_IGNORED, f"{pending.url[:300]}: fetched with --ignore-opt-out"))
    return sample


class _Window:
    """Rows in input order, fetched ahead: at most ``rows`` of them, holding at most ``size`` body bytes."""

    def __init__(self, rows: int, size: int):
        self.rows, self.size = rows, size
        self.queue: deque[_Row] = deque()
        self.held = 0  # bytes of the bodies received for rows still in the queue
        self._lock = threading.Lock()

    def add(self, pending: _Row) -> None:
        self.queue.append(pending)
        if pending.fetch is not None:
            pending.fetch.add_done_callback(self._received)

    @staticmethod
    def _size(future: Future) -> int:
        return 0 if future.cancelled() or future.exception() is not None else len(future.result().body or b"")

    def _received(self, future: Future) -> None:  # runs on the fetcher's thread
        with self._lock:
            self.held += self._size(future)

    def full(self) -> bool:
        return len(self.queue) > self.rows or self.held > self.size

    def pop(self) -> _Row:
        pending = self.queue.popleft()
        if pending.fetch is not None:
            pending.fetch.exception()  # wait for it to end
            with self._lock:
                self.held -= self._size(pending.fetch)
        return pending


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """One sample per row whose image downloads and checks out, in input order; every other row a skip."""
    from mmidx.fetch.client import FetchPool

    options = context.options
    columns = list(dict.fromkeys((options.url_column, caption_column(options), *options.keep_columns)))
    earlier = _Earlier(options.retry_failed, unit) if options.retry_failed is not None else None
    if context.side_folder is None:
        raise SourceError("the urls source writes a fetch ledger per unit; it runs inside mmidx build")
    window = _Window(WINDOW_PER_FETCH * options.fetch_concurrency, WINDOW_BYTES)
    with FetchPool(fetch_settings(options)) as pool, LedgerWriter(context.side_folder) as ledger:
        for item in read_table(unit, columns):
            window.add(_start(item, options, pool, earlier))
            while window.queue and (window.full() or window.queue[0].ready()):
                yield _finish(unit, window.pop(), context, ledger)
        while window.queue:
            yield _finish(unit, window.pop(), context, ledger)
