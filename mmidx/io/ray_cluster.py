"""A Ray cluster for mmidx's engines (the build's and precache's): joined or started for the duration of a
job, and the user's exception recovered from a failed task. Ray is an optional extra (``mmidx[ray]``),
imported only here and by the engines that use it.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmidx.errors import MMIDXError, import_extra

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESTALE, errno.EBUSY})


class TransientOSError(MMIDXError, OSError):
    """An OSError worth retrying the task for (Ray retries exactly this type)."""


@contextmanager
def ray_cluster(address: str | None, workers: int) -> Iterator[Any]:
    """The ``ray`` module, joined to the cluster at ``address`` (default: ``RAY_ADDRESS``, else a local
    one of ``workers`` CPUs and no dashboard) unless Ray is initialised already; shut down if started here."""
    ray = import_extra("ray", "ray", "--engine ray")
    started_here = not ray.is_initialized()
    if started_here:
        local = {} if address else {"num_cpus": workers, "include_dashboard": False}
        ray.init(address=address, log_to_driver=False, configure_logging=False, **local)
    try:
        yield ray
    finally:
        if started_here:
            ray.shutdown()


def task_exception(ray: Any, error: Exception) -> BaseException:
    """A task's own exception out of Ray's ``RayTaskError`` wrapper (the wrapper when it has none)."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error
