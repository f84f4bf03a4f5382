"""The viewer's page work: run in a bounded pool of threads, answered within a time limit, kept when late.

A page's work reads the dataset and renders HTML in a worker thread (the event loop only moves bytes). The pool
is the cap on work: a request whose time limit passes is answered 503, but its work is never abandoned to a
thread outside the pool, where it would go on uncounted (what ``anyio``'s ``abandon_on_cancel`` does).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from mmidx.errors import MMIDXError
from mmidx.format import FormatError
from mmidx.images.decode import ImageError
from mmidx.toolkit.view import pages
from mmidx.toolkit.view.limits import TIME_LIMIT, WORKERS

MAX_KEPT = 64
MAX_KEPT_BYTES = 64 * 2**20


class Refused(MMIDXError):
    """A request answered with an error page: its status and one line."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str) -> HTMLResponse:
    """The error page of ``status`` saying ``message`` in one line."""
    return HTMLResponse(pages.error_page(status, message), status_code=status)


def _answer(work: Callable[[Request], Response], request: Request) -> Response:
    """``work(request)`` in a worker thread, with the refusals and damaged data it meets as error pages."""
    try:
        return work(request)
    except Refused as refused:
        return error_response(refused.status, str(refused))
    except (FormatError, ImageError) as damaged:  # damaged data: what is wrong, in one line
        return error_response(500, f"cannot be read: {damaged}")


class Workers:
    """Page work in a pool of ``workers`` threads, each URL's work once at a time, answered within ``time_limit``.

    A request whose work is not done in time is answered 503; its work goes on in the pool (so the pool's
    size is the cap on work, however many requests time out) and its response is kept for the next request
    of the same URL (a reload, which a second request while it runs joins instead of starting it again).
    Work that has not started when its last requester gives up is dropped, so a flood of slow URLs cannot
    queue unbounded work. Kept responses are served once, the newest ``MAX_KEPT`` and ``MAX_KEPT_BYTES`` at most."""

    def __init__(self, workers: int = WORKERS, time_limit: float = TIME_LIMIT):
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="mmidx-view")
        self.time_limit = time_limit
        self._lock = threading.RLock()  # a done callback runs at once, lock held, when the work is already done
        self._running: dict[tuple[str, str], Future] = {}
        self._waiting: dict[tuple[str, str], int] = {}
        self._kept: OrderedDict[tuple[str, str], Response] = OrderedDict()

    def _finished(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:
            self._running.pop(key, None)
            if not future.cancelled() and future.exception() is None:
                self._kept[key] = future.result()
                while len(self._kept) > MAX_KEPT or \
                        sum(len(response.body) for response in self._kept.values()) > MAX_KEPT_BYTES:
                    self._kept.popitem(last=False)

    async def answer(self, work: Callable[[Request], Response], request: Request) -> Response:
        """The response of ``work`` to ``request``, or a 503 page once ``time_limit`` has passed."""
        key = (request.url.path, request.url.query)
        with self._lock:
            kept = self._kept.pop(key, None)
            if kept is not None:
                return kept
            future = self._running.get(key)
            if future is None:
                future = self._running[key] = self.pool.submit(_answer, work, request)
                future.add_done_callback(lambda done: self._finished(key, done))
        self._waiting[key] = self._waiting.get(key, 0) + 1  # on the event loop's thread only
        waited = asyncio.wrap_future(future)
        try:
            response = await asyncio.wait_for(asyncio.shield(waited), self.time_limit)
        except TimeoutError:
            waited.add_done_callback(lambda done: done.cancelled() or done.exception())  # nobody reads it now
            if self._waiting[key] == 1:
                future.cancel()  # not started: dropped; started: it finishes and is kept
            return error_response(503, f"this page took longer than {self.time_limit:g} s to prepare; what was "
                                       "computed is kept: reload it in a moment")
        finally:
            self._waiting[key] -= 1
            if not self._waiting[key]:
                del self._waiting[key]
        with self._lock:
            self._kept.pop(key, None)  # served to its requester: nothing to keep
        return response
