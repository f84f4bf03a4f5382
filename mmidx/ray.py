"""Ray Data for mmidx datasets, at the short path a user guesses: ``from mmidx.ray import read_mmidx, write_mmidx``.

``read_mmidx(prefix, a list of them, or a data.yaml)`` is a ``ray.data.Dataset`` of the samples;
``write_mmidx(dataset, output, tokenizer)`` writes t2i rows back as an mmidx dataset. The implementation lives in
:mod:`mmidx.toolkit.ray_data` and may move; this path stays. Needs Ray (``pip install "mmidx[ray]"``).
"""

from mmidx.toolkit.ray_data import (
                                    COLUMNS,
                                    DEFAULT_COLUMNS,
                                    MMIDXDatasink,
                                    MMIDXDatasource,
                                    RayWriteError,
                                    read_mmidx,
                                    write_mmidx,
)

__all__ = ["COLUMNS", "DEFAULT_COLUMNS", "MMIDXDatasink", "MMIDXDatasource", "RayWriteError", "read_mmidx",
           "write_mmidx"]
