"""One module per raw source type; each turns its input rows into samples for the builder.

Every source module implements the same two functions and a few constants:

* ``KIND``: ``"multimodal"`` or ``"text"``, the kind of dataset it writes;
* ``EXTENSIONS``: the file name endings it reads when an input is a directory;
* ``work_units(inputs, options) -> list[WorkUnit]``: cut the inputs into independent units (a file,
  a row-group range of a large parquet file, a line-aligned byte range of a large JSONL file);
  each unit becomes one shard of a parallel build;
* ``read(unit, context) -> Iterator[SourceSample | SourceDocument | Skip]``: the unit's rows in
  order, each either built or skipped with a reason from :data:`SKIP_REASONS`.

Sources hold no state between rows. Every random draw comes from ``context.rng(file, row)``,
so a row builds the same way in any worker, in any shard layout, on any rerun.
"""

from __future__ import annotations

import hashlib
import importlib
import posixpath
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from types import ModuleType
from typing import Any

from mmidx.errors import MMIDXError
from mmidx.fetch import outcomes
from mmidx.sources.elements import Element, StoredImage

FUNCTION_SOURCE = "function"  # the source of mmidx.write (a user's function), not one of mmidx build's
SOURCE_NAMES = ("t2i", "edit", "vlm", "chat", "text", "prompts", "wds", "video_gen", "hf", "urls")

SKIP_REASONS = {
    "undecodable_image": "image bytes that are not an image, or a truncated or corrupt image",
    "decompression_bomb": "image with more pixels than --max-image-pixels",
    "invalid_json": "a line or file that is not valid JSON",
    "malformed_record": "valid JSON (or a parquet row) without the fields the source needs, or of the wrong type",
    "missing_file": "image or video file named by a row that does not exist",
    "undecodable_video": "video that PyAV cannot open or decode, or that has no frames",
    "bad_captions": "captions missing or not a JSON object of strings",
    "instruction_image_mismatch": "edit row whose instruction_list does not have one option list per step",
    "no_loss_turn": "conversation without a text that carries loss (BAGEL skips these)",
    "empty_text": "text, prompt or document that is missing or empty",
    "unreadable_row_group": "parquet row group that cannot be read (every row of it is counted)",
    "unreadable_file": "input file that cannot be opened or read to its end",
    "no_target_frames": "video_gen row whose condition_frames leave no frame to generate in a view's frame draw",
    "function_error": "mmidx.write: the user's function raised an exception for this input",
    "text_too_long": "a text of more tokens than --max-text-tokens (default 1,000,000)",
    **outcomes.SKIP_REASONS,  # fetch:<class>, one per download failure class (sources urls, prompts)
}

WARNING_REASONS = {
    "image_placeholder_mismatch": "LLaVA row whose <image> count differs from its image count; built BAGEL's way "
                                  "(images beyond the placeholders are not placed, placeholders beyond the images "
                                  "are dropped)",
    **outcomes.WARNING_OUTCOMES,
}


def pil_pixel_limit() -> int:
    """The pixel count above which PIL itself refuses to open an image (2 × ``Image.MAX_IMAGE_PIXELS``)."""
    from PIL import Image

    return 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else 2**62


def _fps_sampling(sample: str) -> bool:
    """Whether ``sample`` is BAGEL's ``fps<X>`` with a finite X > 0."""
    try:
        return sample.startswith("fps") and 0 < float(sample[3:]) < float("inf")
    except ValueError:
        return False


# Views (augmentations) per sample a build materialises at most: epoch e reads view e mod views, so views past a
# run's epochs are never read, and each is stored for every sample (a t2i view's plan is about 40 bytes: 16 rows of
# 1,024 views make a 0.66 MB plan; 1,000,000 views of 20 rows ran for minutes toward 800 MB).
MAX_VIEWS = 1024


@dataclass(frozen=True)
class SourceOptions:
    """Everything that decides what a source builds from a row (recorded in the dataset's metadata)."""

    views: int = 4
    seed: int = 0
    image_root: str | None = None
    max_image_size: int | None = None
    max_image_pixels: int | None = None  # None: mmidx.images.decode.DEFAULT_MAX_PIXELS
    max_text_tokens: int = 1_000_000  # a row with a longer text (in tokens) is skipped: text_too_long
    min_frames: int = 8
    max_frames: int = 12
    frame_quality: int | None = None  # None: video frames stored losslessly (WebP); 1..100: JPEG quality
    frame_sample: str = "rand"  # BAGEL's FrameSampler sample: rand, middle or fps<X>
    frame_fix_start: int | None = None  # with middle: frame = interval start + fix_start
    text_key: str = "text"
    extra_keys: tuple[str, ...] = ()
    # chat: a checked chat config (mmidx.sources.chat_config); None: extra_keys + conversation, as always
    chat_config: dict[str, Any] | None = field(default=None, metadata={"recorded": "unless None"})
    prompt_key: str = "prompt"
    caption_key: str = "caption"
    group_decay: float = 1.0  # video_gen: split_integer_exp_decay's ng_sample_decay (1.0: group count uniform)
    grouping: bool = True  # video_gen: False makes the target frames one split (BAGEL's _add_video)
    image_column: str | None = None  # hf: the image (or image list) column; None: "image", else "images"
    caption_columns: tuple[str, ...] = ()  # hf: caption columns ((): the first of captions, caption, text, texts);
    # urls: the one caption column ((): "caption")
    keep_columns: tuple[str, ...] = ()  # hf, urls: columns kept as each sample's extra JSON
    split: str | None = None  # hf: the split of a DatasetDict folder or of parquet files in the hub's layout
    rows_per_shard: int = 20_000
    bytes_per_shard: int = 256 << 20
    # urls (and prompts' http(s) images): which columns, and how to fetch (mmidx.fetch.client.FetchSettings)
    url_column: str = "url"
    fetch_concurrency: int = field(default=64, metadata={"recorded": False})  # never changes a byte
    per_host: int = field(default=16, metadata={"recorded": False})
    fetch_timeout: float = 20.0
    fetch_retries: int = 2
    max_image_bytes: int = 32 << 20
    ignore_opt_out: bool = False
    user_agent_token: str = ""
    resolve: tuple[str, ...] = field(default=(), metadata={"recorded": False})  # "host=address", as curl's
    retry_failed: str | None = None  # prefix of an earlier urls build: refetch only its transient failures
    # mmidx.write: the user's function and inputs (mmidx.sources.function.UserFunction), recorded by its summary
    function: Any = field(default=None, metadata={"recorded": False})

    def recorded(self) -> dict[str, Any]:
        """The options that decide what is built, as the build config records them (not how fast it is
        fetched: concurrency and per-host caps never change a byte, so a rerun may change them)."""
        recorded = {f.name: getattr(self, f.name) for f in fields(self)
                    if f.metadata.get("recorded", True) is True
                    or (f.metadata.get("recorded") == "unless None" and getattr(self, f.name) is not None)}
        if self.function is not None:
            recorded["function"] = self.function.recorded()
        return recorded

    def __post_init__(self) -> None:
        if self.chat_config is not None and self.extra_keys:
            raise ValueError("extra_keys and chat_config both order a chat prompt: list the keys in the chat "
                             "config's message_construction instead")
        if not 1 <= self.views <= MAX_VIEWS:
            raise ValueError(f"views must lie in 1..{MAX_VIEWS:,}, not {self.views:,}: epoch e reads view e mod views, "
                             "so views past the run's epochs are never read, and every sample stores the plan of "
                             "each of its views")
        if self.max_text_tokens < 1:
            raise ValueError(f"max_text_tokens must be at least 1, not {self.max_text_tokens}")
        if not 1 <= self.min_frames <= self.max_frames:
            raise ValueError(f"need 1 <= min_frames <= max_frames, got {self.min_frames}..{self.max_frames}")
        if self.frame_quality is not None and not 1 <= self.frame_quality <= 100:
            raise ValueError(f"frame_quality is a JPEG quality in 1..100 (or None: lossless), not {self.frame_quality}")
        if self.frame_sample not in ("rand", "middle") and not _fps_sampling(self.frame_sample):
            raise ValueError(f"frame sampling {self.frame_sample!r} is not one of BAGEL's: rand, middle, fps<X> "
                             "(e.g. fps0.5)")
        if self.frame_fix_start is not None and (self.frame_sample != "middle" or self.frame_fix_start < 0):
            raise ValueError("fix_start is a frame offset (>= 0) that only sample 'middle' uses")
        if not 0.0 <= self.group_decay <= 1.0:
            raise ValueError(f"group_decay is split_integer_exp_decay's decay in [0, 1] (1.0: every group count "
                             f"equally likely, below: fewer groups preferred), not {self.group_decay}")
        if self.rows_per_shard < 1 or self.bytes_per_shard < 1:
            raise ValueError("rows_per_shard and bytes_per_shard must be positive")
        if self.fetch_concurrency < 1 or self.per_host < 1 or not self.fetch_timeout > 0 or self.fetch_retries < 0 \
                or self.max_image_bytes < 1:
            raise ValueError("need fetch_concurrency >= 1, per_host >= 1, fetch_timeout > 0, fetch_retries >= 0 and "
                             "max_image_bytes >= 1")
        if not all("=" in entry for entry in self.resolve):
            raise ValueError(f"resolve entries are HOST=ADDRESS, not {list(self.resolve)}")
        if self.max_image_pixels is not None:
            pil_limit = pil_pixel_limit()
            if not 1 <= self.max_image_pixels <= pil_limit:
                raise ValueError(f"max_image_pixels must lie in 1..{pil_limit} (PIL itself refuses larger images), "
                                 f"not {self.max_image_pixels}")


@dataclass(frozen=True)
class WorkUnit:
    """An independent piece of the input: rows ``[start, stop)`` of one file, in the file's own terms.

    For parquet ``start``/``stop`` are row-group numbers, for JSONL byte offsets at line starts,
    and ``(0, None)`` means the whole file. ``first_row`` is the row number of the unit's first row
    in its file, so rows are numbered the same however a file is cut.
    """

    path: str
    start: int = 0
    stop: int | None = None
    first_row: int = 0
    rows: int | None = None  # rows in the unit, when the file's metadata says so
    identity: str = ""  # size and modification time of the file when planned (reruns compare it)
    line_based: bool = False  # rows are line numbers (reported 1-based, as editors show them)

    @property
    def label(self) -> str:
        name = posixpath.basename(self.path.rstrip("/")) or self.path
        return name if self.stop is None else f"{name}[{self.start}:{self.stop}]"


@dataclass
class SourceSample:
    """One built row of a multimodal source: its texts, images and one sequence plan per view."""

    row: int
    texts: list[list[int]]
    images: list[StoredImage]
    views: list[list[Element]]
    extra: dict[str, Any] | None = None
    warnings: list[tuple[str, str]] = field(default_factory=list)  # (key of WARNING_REASONS, detail): built


@dataclass
class SourceDocument:
    """One built row of a text source: one token sequence (a Megatron document)."""

    row: int
    tokens: list[int]


@dataclass
class Skip:
    """A row that was not built, and why (``reason`` is a key of :data:`SKIP_REASONS`)."""

    row: int
    reason: str
    detail: str


class Skipped(MMIDXError):
    """Raised while building a row to skip it with a counted reason."""

    def __init__(self, reason: str, detail: str):
        if reason not in SKIP_REASONS:
            raise ValueError(f"unknown skip reason {reason!r}")
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail

    def at(self, row: int) -> Skip:
        return Skip(row, self.reason, self.detail)


class SourceError(MMIDXError, ValueError):
    """Input that breaks a source's contract as a whole (not one bad row): the build stops."""


@dataclass
class SourceContext:
    """What a source needs while reading a unit: tokenizer, options, seeded draws and timings."""

    tokenizer: Any  # mmidx.tokenizer.Tokenizer (kept duck-typed so tests may pass a stand-in)
    options: SourceOptions
    seconds: dict[str, float] = field(default_factory=dict)
    side_folder: str | None = None  # where a unit may write side files published with its shard (fetch ledger)

    def rng(self, path: str, row: int) -> random.Random:
        """The random generator of one row: a function of (seed, file name, row) only.

        The file's base name (not its folder or URI scheme) is used, so moving data keeps its draws.
        """
        name = posixpath.basename(path.rstrip("/"))
        key = hashlib.sha256(f"{self.options.seed}\0{name}\0{row}".encode()).digest()
        return random.Random(int.from_bytes(key[:8], "little"))

    @contextmanager
    def timed(self, what: str) -> Iterator[None]:
        """Add the time spent in the block to ``seconds[what]`` (reported per build)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[what] = self.seconds.get(what, 0.0) + time.perf_counter() - start

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of every text (timed as ``tokenize``)."""
        with self.timed("tokenize"):
            return self.tokenizer.encode_batch(texts)


def default_max_skip_rate(name: str) -> float:
    """The skip rate past which a build of source ``name`` fails unless told otherwise: the source module's
    ``MAX_SKIP_RATE`` (URL tables, whose downloads fail as a matter of course: 1.0), else 1%."""
    return getattr(get_source(name), "MAX_SKIP_RATE", 0.01)


def get_source(name: str) -> ModuleType:
    """The module implementing source ``name`` (one of :data:`SOURCE_NAMES`, or ``function``: :func:`mmidx.write`)."""
    if name not in SOURCE_NAMES and name != FUNCTION_SOURCE:
        raise ValueError(f"unknown source {name!r}; choose one of {', '.join(SOURCE_NAMES)}")
    return importlib.import_module(f"mmidx.sources.{name}")
