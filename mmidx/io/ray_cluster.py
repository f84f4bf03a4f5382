"""A Ray cluster for mmidx's engines (the build's and precache's): joined or started for the duration of a
job, and the user's exception recovered from a failed task. Ray is an optional extra (``mmidx[ray]``),
imported only here and by the engines that use it.

A local cluster started here goes with its driver even when the driver is killed (``kill -9``): Ray's own
processes (GCS, raylet, the dashboard and runtime-env agents, workers) notice a dead driver only by their
health checks, 10-15 s later. A small reaper process, started beside the cluster, waits on a pipe that only
the driver holds; when it closes, by a normal end or by the driver's death, it kills every process of the
cluster's session at once (Linux: found through ``/proc``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from mmidx.errors import MMIDXError, import_extra

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                              errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ESTALE, errno.EBUSY})


class TransientOSError(MMIDXError, OSError):
    """An OSError worth retrying the task for (Ray retries exactly this type)."""


# The reaper: blocks until its stdin closes (the driver ended or died), then kills the processes of the
# driver's Ray session (their command lines name /tmp/ray/session_<date>_<driver pid>/) and their descendants.
_REAPER = r"""
import os, re, signal, sys
sys.stdin.buffer.read()
session = re.compile(rb"/session_[0-9_-]+_%d/" % int(sys.argv[1]))
parents, members = {}, set()
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            command = f.read()
        with open(f"/proc/{pid}/stat") as f:
            parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        continue
    if session.search(command):
        members.add(int(pid))
while True:
    grown = members | {pid for pid, parent in parents.items() if parent in members}
    if grown == members:
        break
    members = grown
for pid in members:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
"""


@contextmanager
def _reaper() -> Iterator[None]:
    """Kill this driver's local Ray cluster once the block ends or the driver dies (see the module's doc)."""
    if not sys.platform.startswith("linux"):  # no /proc: Ray's health checks end the cluster, later
        yield
        return
    reaper = subprocess.Popen([sys.executable, "-c", _REAPER, str(os.getpid())], stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        yield
    finally:
        reaper.stdin.close()
        reaper.wait()


@contextmanager
def ray_cluster(address: str | None, workers: int) -> Iterator[Any]:
    """The ``ray`` module, joined to the cluster at ``address`` (default: ``RAY_ADDRESS``, else a local
    one of ``workers`` CPUs and no dashboard) unless Ray is initialised already; shut down if started here."""
    ray = import_extra("ray", "ray", "--engine ray")
    if ray.is_initialized():
        yield ray
        return
    local = {} if address or os.environ.get("RAY_ADDRESS") else {"num_cpus": workers, "include_dashboard": False}
    with _reaper() if local else contextlib.nullcontext():
        ray.init(address=address, log_to_driver=False, configure_logging=False, **local)
        try:
            yield ray
        finally:
            ray.shutdown()


def task_exception(ray: Any, error: Exception) -> BaseException:
    """A task's own exception out of Ray's ``RayTaskError`` wrapper (the wrapper when it has none)."""
    if isinstance(error, ray.exceptions.RayTaskError) and isinstance(error.cause, BaseException):
        return error.cause
    return error
