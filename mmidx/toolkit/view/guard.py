"""The viewer's defences below its pages: slow and greedy connections, foreign Host headers, headers on every answer.

uvicorn (0.54, with its h11 protocol) times out only *idle* keep-alive connections: a connection that sends
part of a request (``GET / HTTP/1.1\\r\\n``) and then nothing is held forever, and once ``limit_concurrency``
connections are held every other request is answered 503. :func:`guarded_protocol` is uvicorn's h11 protocol
with two rules added:

- a request must arrive whole (headers and body) within ``request_timeout`` seconds of the connection's opening
  or of the previous response, or the connection is closed; a client that reads nothing of a response that
  fills the send buffer for as long is dropped;
- a client address keeps at most ``per_client`` connections: a new one closes that client's oldest connection
  with no request in progress (stalled or idle), or itself when every other one is busy. A flood of stalled
  connections so costs its sender its own oldest ones, never the next real request; on loopback, where every
  client has the same address, this is what keeps the viewer answering.

:class:`Front` is the outermost ASGI layer: it checks the Host header (``[::1]:8765`` included), adds the
security headers to every response (Starlette's own 500 page included, which bypasses app middleware), and
turns an exception no route handled into a 500 page and one log line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mmidx.toolkit.view.limits import PER_CLIENT, REQUEST_TIMEOUT

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self' data:; style-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client's states in which its request has not arrived whole
_log = logging.getLogger("mmidx.view")


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive and a cap on connections per client
    (set by :func:`guarded_protocol`, which makes a subclass per server)."""

    request_timeout: ClassVar[float] = REQUEST_TIMEOUT
    per_client: ClassVar[int] = PER_CLIENT
    clients: ClassVar[dict[str, dict[GuardedH11, None]]] = {}  # open connections by client address, oldest first

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._unread: asyncio.TimerHandle | None = None
        self._address = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._address = self.client[0] if self.client else ""
        mine = self.clients.setdefault(self._address, {})
        mine[self] = None
        if len(mine) > self.per_client:
            victim = next((other for other in mine if other is not self and other._deadline is not None), self)
            victim._close()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._forget()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def pause_writing(self) -> None:
        """The response fills the send buffer: the client must read some of it within ``request_timeout``."""
        super().pause_writing()
        if self._unread is None:
            self._unread = self.loop.call_later(self.request_timeout, self._abort)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._unread is not None:
            self._unread.cancel()
            self._unread = None

    def _abort(self) -> None:
        """Drop a connection whose client reads nothing of its response (closing would wait to send it)."""
        self._forget()
        self.transport.abort()

    def _watch(self) -> None:
        """Arm the deadline while the client owes a request (from the start of the wait), disarm it once it came."""
        waiting = self.conn.their_state in _WAITING and not self.transport.is_closing()
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout, self._close)
        elif not waiting and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self) -> None:
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def _forget(self) -> None:
        for timer in (self._deadline, self._unread):
            if timer is not None:
                timer.cancel()
        self._deadline = self._unread = None
        mine = self.clients.get(self._address)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del self.clients[self._address]


def guarded_protocol(request_timeout: float = REQUEST_TIMEOUT, per_client: int = PER_CLIENT) -> type[GuardedH11]:
    """A :class:`GuardedH11` subclass with these limits and its own connection registry, for one server
    (``uvicorn.Config(app, http=guarded_protocol())``)."""
    if not request_timeout > 0 or per_client < 1:
        raise ValueError(f"request_timeout must be > 0 and per_client >= 1, not {request_timeout} and {per_client}")
    return type("GuardedH11", (GuardedH11,), {"request_timeout": float(request_timeout), "per_client": int(per_client),
                                              "clients": {}})


def host_name(header: str) -> str:
    """The host part of a Host header: ``[::1]:8765`` → ``::1``, ``localhost:80`` → ``localhost``."""
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Front:
    """The outermost ASGI layer of the viewer: Host check, security headers on every response, and a 500 page
    (with one log line, no traceback) for any exception that got this far.

    ``allowed_hosts`` are names or addresses (IPv6 without brackets); ``"*"`` allows any. ``error(status,
    message)`` renders an error page as a Starlette response."""

    def __init__(self, app: Any, allowed_hosts: Sequence[str], error: Callable[[int, str], Any]):
        self.app = app
        self.allowed = {host.strip("[]").lower() for host in allowed_hosts}
        self.error = error
        self.headers = [(key.lower().encode(), value.encode()) for key, value in HEADERS.items()]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def with_headers(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), *self.headers]}
            await send(message)

        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
        if "*" not in self.allowed and host_name(host).lower() not in self.allowed:
            await self.error(400, "invalid host header: this viewer answers to its loopback names only (a page on "
                                  "another site cannot reach it through DNS)")(scope, receive, with_headers)
            return
        try:
            await self.app(scope, receive, with_headers)
        except Exception as error:  # a bug: one line in the log, a 500 page to the browser
            _log.error("mmidx view: internal error on %s %s: %s: %s", scope["method"], scope["path"][:200],
                       type(error).__name__, str(error)[:200])
            if not started:
                await self.error(500, f"internal error {type(error).__name__}: {str(error)[:200]}")(
                    scope, receive, with_headers)
