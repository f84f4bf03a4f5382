"""Ray Data: mmidx datasets read as a ``ray.data.Dataset`` (``read_mmidx``) and t2i rows written back (``write_mmidx``).

The path for filtering, re-captioning or scoring a dataset on a cluster and writing it back. Needs Ray
(``pip install "mmidx[ray]"``); ``import mmidx`` does not import it.
"""

from mmidx.toolkit.ray_data.datasink import MMIDXDatasink, RayWriteError, write_mmidx
from mmidx.toolkit.ray_data.datasource import COLUMNS, DEFAULT_COLUMNS, MMIDXDatasource, read_mmidx

__all__ = ["COLUMNS", "DEFAULT_COLUMNS", "MMIDXDatasink", "MMIDXDatasource", "RayWriteError", "read_mmidx",
           "write_mmidx"]
