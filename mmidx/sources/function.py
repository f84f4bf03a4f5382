"""``function``: samples made by the user's own Python function, one call per input (:func:`mmidx.write`).

This is the source behind :func:`mmidx.write` (not a ``mmidx build --source``): the build's
:class:`UserFunction` carries the function and its inputs to every worker. The inputs are cut into
units of ``inputs_per_unit`` consecutive inputs, a number that depends on the inputs alone (never on
the worker count), so the shards and therefore the merged files are the same at any worker count.

``fn(input)`` returns or yields samples, each a mapping with

* ``texts``: a list of strings (tokenized by the build's tokenizer) or of token-id lists;
* ``images``: a list of encoded image bytes, image file paths or PIL images (stored as PNG); each is
  probed and checked as every source's images are (``--max-image-pixels``, ``--max-image-size``);
* ``views``: the sequence plan, a list of views, each a list of :class:`mmidx.Element` whose payload
  numbers a text or an image of this sample (one view may be given as a plain list of elements);
* ``extra`` (optional): JSON-serialisable metadata stored with the sample.

An input is built whole or not at all: its samples are collected first, and if ``fn`` raises (or
yields something that is not a sample) the input is a counted skip — ``function_error`` with the
exception, or the :class:`mmidx.sources.Skipped` reason ``fn`` raised itself — and none of its samples
is stored. Samples record their origin as (the function's name, the input's index).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mmidx.sources import Skip, Skipped, SourceContext, SourceError, SourceOptions, SourceSample, WorkUnit
from mmidx.sources.elements import Element, StoredImage
from mmidx.sources.media import ingest_image, ingest_image_file

KIND = "multimodal"
EXTENSIONS = ()
TARGET_UNITS = 64  # the default cut: about this many units, of 1 to MAX_DEFAULT_INPUTS_PER_UNIT inputs
MAX_DEFAULT_INPUTS_PER_UNIT = 1000


def default_inputs_per_unit(count: int) -> int:
    """Inputs per unit when the user does not say: about ``TARGET_UNITS`` units, at most 1,000 inputs each."""
    return max(1, min(MAX_DEFAULT_INPUTS_PER_UNIT, math.ceil(count / TARGET_UNITS)))


def input_identity(item: Any) -> str:
    """What a rerun compares an input by: its JSON form (its ``repr`` if it has none) and the size and
    modification time of every existing file it names — itself, or a value of a dict, list or tuple input
    (so an edited image is built again)."""
    try:
        text = json.dumps(item, sort_keys=True, ensure_ascii=False, default=os.fspath)
    except (TypeError, ValueError):
        text = repr(item)
    values = item.values() if isinstance(item, Mapping) else item if isinstance(item, list | tuple) else [item]
    for value in values:
        if isinstance(value, str | os.PathLike):
            try:
                stat = os.stat(value)
            except (OSError, ValueError):  # not a file name (a caption), or too long or odd to be one
                continue
            text += f"\0{os.fspath(value)}:{stat.st_size}:{stat.st_mtime_ns}"
    return text


@dataclass(frozen=True)
class UserFunction:
    """The user's ``fn`` and its ``inputs``, cut into units of ``inputs_per_unit``; ``name`` labels the samples.

    Its :meth:`recorded` form (name, input count, digest of every input's identity, cut) goes into the
    build's configuration, so a rerun with other inputs does not reuse their shards and does not
    replace a dataset built from other inputs without ``force``.
    """

    fn: Callable[[Any], Any]
    inputs: tuple[Any, ...]
    name: str
    inputs_per_unit: int
    identities: tuple[str, ...]

    @classmethod
    def of(cls, fn: Callable[[Any], Any], inputs: Iterable[Any], name: str | None = None,
           inputs_per_unit: int | None = None) -> UserFunction:
        """Check ``fn`` and ``inputs`` and fix the cut (``inputs`` is read once, into a tuple)."""
        if not callable(fn):
            raise TypeError(f"fn must be a function of one input, not {type(fn).__name__}")
        if isinstance(inputs, str | bytes | Mapping):
            raise TypeError("inputs must be a list (or another iterable) of inputs, not one "
                            f"{type(inputs).__name__}; wrap a single input in a list")
        items = tuple(inputs)
        if not items:
            raise ValueError("give at least one input")
        if inputs_per_unit is not None and inputs_per_unit < 1:
            raise ValueError(f"inputs_per_unit must be at least 1, not {inputs_per_unit}")
        name = name or getattr(fn, "__qualname__", None) or type(fn).__name__
        return cls(fn, items, name, inputs_per_unit or default_inputs_per_unit(len(items)),
                   tuple(input_identity(item) for item in items))

    def unit_identity(self, start: int, stop: int) -> str:
        return hashlib.sha256("\0\0".join(self.identities[start:stop]).encode()).hexdigest()

    def recorded(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": len(self.inputs), "inputs_per_unit": self.inputs_per_unit,
                "inputs_sha256": self.unit_identity(0, len(self.inputs))}


def _function(options: SourceOptions) -> UserFunction:
    if options.function is None:
        raise SourceError("the function source builds only through mmidx.write(fn, inputs, output, ...)")
    return options.function


def work_units(inputs: Sequence[str], options: SourceOptions) -> list[WorkUnit]:
    """Runs of ``inputs_per_unit`` consecutive inputs of the function (``inputs``: its name, for the label)."""
    function = _function(options)
    count, size = len(function.inputs), function.inputs_per_unit
    return [WorkUnit(function.name, start, min(start + size, count), first_row=start, rows=min(size, count - start),
                     identity=function.unit_identity(start, min(start + size, count)))
            for start in range(0, count, size)]


def _image(value: Any, context: SourceContext) -> StoredImage:
    if isinstance(value, bytes | bytearray | memoryview):
        return ingest_image(bytes(value), context)
    if isinstance(value, str | os.PathLike):
        return ingest_image_file(os.fspath(value), context)
    if hasattr(value, "save") and hasattr(value, "mode"):  # a PIL image: stored losslessly
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return ingest_image(buffer.getvalue(), context)
    raise Skipped("malformed_record", f"an image is {type(value).__name__}; give bytes, a file path or a PIL image")


def _views(value: Any) -> list[list[Element]]:
    if isinstance(value, Sequence) and value and all(isinstance(item, Element) for item in value):
        value = [value]  # one view given as its list of elements
    if not (isinstance(value, Sequence) and value and all(
            isinstance(view, Sequence) and view and all(isinstance(e, Element) for e in view) for view in value)):
        raise Skipped("malformed_record", "views must be a non-empty list of views, each a non-empty list of "
                                          "mmidx.Element")
    return [list(view) for view in value]


def _sample(row: int, sample: Any, context: SourceContext) -> SourceSample:
    """One sample ``fn`` gave for the input of index ``row``, tokenized, probed and checked."""
    if not isinstance(sample, Mapping):
        raise Skipped("malformed_record", f"fn gave a {type(sample).__name__}, not a sample (a dict of texts, "
                                          "images, views and optionally extra)")
    unknown = set(sample) - {"texts", "images", "views", "extra"}
    if unknown:
        raise Skipped("malformed_record", f"a sample has unknown keys {sorted(unknown)}; it takes texts, images, "
                                          "views, extra")
    texts, images = list(sample.get("texts") or ()), list(sample.get("images") or ())
    strings = [i for i, text in enumerate(texts) if isinstance(text, str)]
    encoded = context.encode_batch([texts[i] for i in strings]) if strings else []
    for i, tokens in zip(strings, encoded, strict=True):
        texts[i] = tokens
    vocab = context.tokenizer.vocab_size
    for i, text in enumerate(texts):
        if isinstance(text, bytes | bytearray) or not (isinstance(text, Sequence) or hasattr(text, "dtype")):
            raise Skipped("malformed_record", f"text {i} is {type(text).__name__}; give a string or token ids")
        try:
            texts[i] = ids = [int(token) for token in text]
        except (TypeError, ValueError) as error:
            raise Skipped("malformed_record", f"text {i} is not a list of token ids: {error}") from error
        if ids and not (0 <= min(ids) and max(ids) < vocab):
            raise Skipped("malformed_record", f"text {i} has token ids {min(ids)}..{max(ids)}, outside the "
                                              f"tokenizer's vocabulary 0..{vocab - 1}")
    views = _views(sample.get("views"))
    for view in views:
        for element in view:
            count = len(texts) if element.kind == "text" else len(images)
            if not 0 <= element.payload < count:
                raise Skipped("malformed_record", f"a {element.kind} element names payload {element.payload}, but "
                                                  f"the sample has {count} of those")
            try:
                element.record()  # checks kind, flags and ranges
            except ValueError as error:
                raise Skipped("malformed_record", str(error)) from error
    extra = sample.get("extra")
    if extra is not None:
        try:
            json.dumps(extra)
        except (TypeError, ValueError) as error:
            raise Skipped("malformed_record", f"extra is not JSON-serialisable: {error}") from error
    return SourceSample(row, texts, [_image(image, context) for image in images], views, extra)


def _samples_of(function: UserFunction, row: int, context: SourceContext) -> list[SourceSample]:
    """Every sample of input ``row``, or :class:`Skipped` for the first thing that went wrong."""
    try:
        made = function.fn(function.inputs[row])
        made = [made] if made is None or isinstance(made, Mapping) else list(made)
    except Skipped:
        raise
    except Exception as error:
        raise Skipped("function_error", f"{type(error).__name__}: {error}") from error
    return [_sample(row, sample, context) for sample in made if sample is not None]


def read(unit: WorkUnit, context: SourceContext) -> Iterator[SourceSample | Skip]:
    """The samples of the unit's inputs in input order; an input that fails is one counted skip."""
    function = _function(context.options)
    for row in range(unit.start, unit.stop if unit.stop is not None else len(function.inputs)):
        try:
            samples = _samples_of(function, row, context)
        except Skipped as skipped:
            yield skipped.at(row)
            continue
        yield from samples
