"""The dataset viewer (``mmidx view``) from Python, at a short path: ``from mmidx.view import Catalog, serving``.

:class:`Catalog` holds the datasets (prefixes or a ``data.yaml``) the viewer shows; ``serving(catalog)`` serves
them on 127.0.0.1 in a background thread for the ``with`` block and yields the URL. The implementation lives in
:mod:`mmidx.toolkit.view` and may move; this path stays. Needs the ``view`` extra (``pip install "mmidx[view]"``).
"""

from mmidx.toolkit.view.app import serving
from mmidx.toolkit.view.catalog import Catalog

__all__ = ["Catalog", "serving"]
