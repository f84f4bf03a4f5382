"""Build datasets from raw sources: in parallel or on a cluster, resumable after a crash, never losing a row silently.

``build_dataset`` cuts the inputs into work units (``mmidx.sources``, :mod:`mmidx.ingest.plan`),
builds each unit into its own shard (:mod:`mmidx.ingest.shard`) on an engine — worker processes on
this machine or tasks of a Ray cluster (:mod:`mmidx.ingest.engines`) — then merges the shards in unit
order into ``OUTPUT`` and writes ``OUTPUT.report.json`` (:mod:`mmidx.ingest.merge`,
:mod:`mmidx.ingest.report`). Every row is either built or skipped with a counted reason; the result
does not depend on the engine, the number of workers or nodes, or on how often the build was
interrupted: the files are byte-identical.

Crash safety and resumption:

* a shard is published by renaming its attempt's folder into place, its report inside, so a
  shard on disk is always whole; it is reused by a rerun only if its report names the same unit and
  build configuration (including the input file's size and modification time) and the shard opens
  with the metadata checksum the report names; otherwise the unit is built again;
* the merged output is finalized by ``mmidx.ingest.writer``, which renames ``P.idx`` into place last: an
  interrupted build never leaves files that open as a dataset, and an old dataset at ``OUTPUT``
  stays intact until the new one replaces it whole;
* ``OUTPUT.report.json`` is written last; a rerun whose report and output match the configuration
  does nothing but finish deleting the shards, which go once the report is written; a dataset at
  ``OUTPUT`` that another build or merge made is replaced only with ``force`` (:mod:`mmidx.ingest.output`),
  and loses its report first;
* ``OUTPUT.lock`` keeps a second build or merge of the same output out while one runs; worker
  processes die with the build.

The build fails (``BuildReport.ok`` is False, the CLI exits 1) when nothing was built (then no
dataset is written) or more than ``max_skip_rate`` of the rows were skipped (the dataset is still
written so it can be inspected).
"""

from mmidx.ingest.bagel import build_from_config
from mmidx.ingest.driver import build_dataset
from mmidx.ingest.function import write
from mmidx.ingest.merge import merge_into
from mmidx.ingest.plan import BuildError, BuildOptions
from mmidx.ingest.report import BuildReport, report_path

__all__ = [
           "BuildError",
           "BuildOptions",
           "BuildReport",
           "build_dataset",
           "build_from_config",
           "merge_into",
           "report_path",
           "write",
]
