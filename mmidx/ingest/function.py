"""``mmidx.write``: a dataset from the user's own function over any inputs, built as ``mmidx build`` builds.

The field's generic writers — MosaicML Streaming's ``MDSWriter``, LitData's ``optimize(fn, inputs,
output_dir, num_workers)`` — take any Python function over any list of inputs. ``write`` is that front
for mmidx: the function and its inputs become the build's source (:mod:`mmidx.sources.function`), and
the build is :func:`mmidx.ingest.build_dataset`'s, with all its guarantees (parallel on this machine or
a Ray cluster, resumable after ``kill -9``, byte-identical at any worker count, every input built or
skipped with a counted reason, ``OUTPUT.report.json``, a dataset that ``mmidx verify`` checks).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from mmidx.ingest.driver import build_dataset
from mmidx.ingest.plan import BuildOptions
from mmidx.ingest.report import BuildReport
from mmidx.sources import FUNCTION_SOURCE, SourceOptions
from mmidx.sources.function import UserFunction


def write(
    fn: Callable[[Any], Any],
    inputs: Iterable[Any],
    output: str | os.PathLike,
    *,
    tokenizer: str,
    workers: int = 1,
    engine: str = "local",
    ray_address: str | None = None,
    inputs_per_unit: int | None = None,
    name: str | None = None,
    max_skip_rate: float = 0.01,
    max_image_size: int | None = None,
    max_image_pixels: int | None = None,
    progress: bool = True,
    force: bool = False,
) -> BuildReport:
    """Build the multimodal dataset ``output`` (a prefix) from ``fn(input)`` for every input of ``inputs``.

    ``fn(input)`` returns or yields samples: dicts of ``texts`` (strings, tokenized with ``tokenizer``,
    or token ids), ``images`` (encoded bytes, file paths or PIL images), ``views`` (the sequence plan: a
    list of views, each a list of :class:`mmidx.Element`) and optionally ``extra`` (JSON metadata); see
    :mod:`mmidx.sources.function`. An input for which ``fn`` raises is skipped and counted
    (``function_error``, with the exception in the report's examples); none of its samples is stored.

    ``inputs`` is read once into a list; it is cut into work units of ``inputs_per_unit`` consecutive
    inputs (default: about 64 units of at most 1,000 inputs), each built into a shard by one of
    ``workers`` processes (``engine="local"``) or one Ray task (``engine="ray"``, on the cluster at
    ``ray_address`` or ``RAY_ADDRESS``, else a new local one), and the shards are merged in input order:
    the files are the same for any ``workers`` and engine. Run the same call again after a crash or a
    ``kill -9`` and finished units are reused; a dataset already at ``output`` built from other inputs
    (compared by their JSON form, and for file paths by size and modification time) or another ``name``
    is replaced only with ``force``. The function's code is not compared: after changing it, pass
    ``force=True`` (or another ``name``), or the shards built earlier are reused. With ``workers`` > 1 the
    workers are forked, so ``fn`` may be any callable; on Ray it must pickle with cloudpickle.

    Returns the :class:`BuildReport` (also written to ``OUTPUT.report.json``); ``report.ok`` is False
    when nothing was built or more than ``max_skip_rate`` of the inputs were skipped.
    """
    function = UserFunction.of(fn, inputs, name, inputs_per_unit)
    options = BuildOptions(
        FUNCTION_SOURCE, (function.name,), os.fspath(tokenizer), os.fspath(output),
        source_options=SourceOptions(function=function, max_image_size=max_image_size,
                                     max_image_pixels=max_image_pixels),
        workers=workers, max_skip_rate=max_skip_rate, progress=progress, engine=engine, ray_address=ray_address,
        force=force)
    return build_dataset(options)
