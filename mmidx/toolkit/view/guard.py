"""The viewer's defences below its pages: slow and greedy connections, oversized heads, foreign Host headers,
headers on every answer.

uvicorn (0.54, with its h11 protocol) times out only *idle* keep-alive connections: a connection that sends
part of a request (``GET / HTTP/1.1\\r\\n``) and then nothing is held forever, and once ``limit_concurrency``
connections are held every other request is answered 503. :func:`guarded_protocol` is uvicorn's h11 protocol
with these rules added:

- a request must arrive whole (headers and body) within ``request_timeout`` seconds of the connection's opening
  or of the previous response, or the connection is closed; a client that reads nothing of a response that
  fills the send buffer for as long is dropped;
- a request's head (request line and headers) over ``MAX_HEAD`` bytes is answered 400, however it arrives (h11
  checks only a head still incomplete, so one that came in a single read passed at any size);
- a client keeps at most ``per_client`` connections, and a new connection always gets in: it closes one of the
  client's others (:meth:`GuardedH11.victim`), never itself.

Who is a client: an address, except that every loopback address is one client (:func:`client_of`). Any local
process can connect from any of 127.0.0.0/8's 16 million addresses, so on loopback an address says nothing about
who connects; counted apart, four of them held 1,024 stalled connections and uvicorn's ``limit_concurrency``
answered everyone 503. On loopback the user's browser shares one budget with every other local program, and
what keeps it answered is which connection makes room for a new one: a browser's next request comes on a new
connection (or one it reuses), while a flood must hold many, stalled or busy.

:class:`Front` is the outermost ASGI layer: it checks the Host header (``[::1]:8765`` included), adds the
security headers to every response (Starlette's own 500 page included, which bypasses app middleware), and
turns an exception no route handled into a 500 page and one log line instead of a traceback.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from mmidx.toolkit.view.limits import MAX_HEAD, PER_CLIENT, REQUEST_TIMEOUT

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; img-src 'self' data:; style-src 'self'; form-action 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Resource-Policy": "same-origin",
}
LOOPBACK = "loopback"
_WAITING = (h11.IDLE, h11.SEND_BODY)  # the client's states in which its request has not arrived whole
_HEAD_END = re.compile(b"\n\r?\n")  # the blank line that ends a head, as h11 finds it
_log = logging.getLogger("mmidx.view")


def client_of(address: str) -> str:
    """The client a connection from ``address`` counts against: the address, or ``LOOPBACK`` for every loopback
    address (127.0.0.0/8, ``::1``, and 127.x.y.z written as IPv6, ``::ffff:127.0.0.2``), which any local process
    may connect from."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return address
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return LOOPBACK if ip.is_loopback or (mapped is not None and mapped.is_loopback) else address


class HeadLimitedConnection(h11.Connection):
    """h11's server connection with its limit on a request's head applied to every head.

    h11 refuses a head over ``max_incomplete_event_size`` only while it is incomplete: one that arrives whole in
    a single read (or is already buffered behind a pipelined request) is parsed at any size. Here a head must end
    within the first ``max_head`` bytes of the buffer, or reading it is a protocol error (uvicorn answers 400).
    The check reads h11's receive buffer, a private part of h11 (as of 0.16), so the viewer's tests of the limit
    fail if h11 changes it."""

    def __init__(self, max_head: int = MAX_HEAD):
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head = max_head

    def _extract_next_receive_event(self) -> Any:
        buffered = self._receive_buffer
        if self.their_state is h11.IDLE and len(buffered) > self.max_head and \
                _HEAD_END.search(buffered._data, 0, self.max_head) is None:
            raise h11.RemoteProtocolError(f"request line and headers over {self.max_head:,} bytes",
                                          error_status_hint=431)
        return super()._extract_next_receive_event()


class Connections:
    """One client's open connections by what each is doing, each group in the order they joined it: ``idle``
    (answered, waiting for the next request), ``unstarted`` (waiting for a first request: new or stalled),
    ``busy`` (a request in progress)."""

    def __init__(self) -> None:
        self.idle: dict[GuardedH11, None] = {}
        self.unstarted: dict[GuardedH11, None] = {}
        self.busy: dict[GuardedH11, None] = {}

    def __len__(self) -> int:
        return len(self.idle) + len(self.unstarted) + len(self.busy)


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request to arrive, a limit on its head and a cap on
    connections per client (set by :func:`guarded_protocol`, which makes a subclass per server)."""

    request_timeout: ClassVar[float] = REQUEST_TIMEOUT
    per_client: ClassVar[int] = PER_CLIENT
    clients: ClassVar[dict[str, Connections]] = {}  # open connections by client

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.conn = HeadLimitedConnection()
        self._deadline: asyncio.TimerHandle | None = None
        self._unread: asyncio.TimerHandle | None = None
        self._client = ""
        self._group: dict[GuardedH11, None] | None = None  # the group of its client's connections it is in
        self.answered = 0  # responses completed on this connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._client = client_of(self.client[0] if self.client else "")
        mine = self.clients.setdefault(self._client, Connections())
        self._file(mine.unstarted)
        if len(mine) > self.per_client:
            self.victim(mine)._evict()
        self._watch()

    def victim(self, mine: Connections) -> GuardedH11:
        """The connection of this client that makes room for this new one, which always gets in.

        In turn: the keep-alive idle the longest (it was answered; closing it costs no request); the oldest
        connection that has not sent a request, once such connections are more than half of the client's (a
        stalled flood pays with its own, and a browser's new connection, which sends its request at once, is the
        newest); else the busy one answered the most requests (of a tie, the one busy the longest): a flood of
        pipelined requests pays with its own connections, which have had their share, and never closes a new
        one waiting for its request to be read. (When no other connection is unstarted or they are at most
        half, busy ones are at least half of the others, so there is one.)"""
        if mine.idle:
            return next(iter(mine.idle))
        oldest = next((other for other in mine.unstarted if other is not self), None)
        if oldest is not None and len(mine.unstarted) > self.per_client // 2:
            return oldest
        return max(mine.busy, key=lambda other: other.answered)

    def waiting(self) -> bool:
        """Whether the client owes this connection a request (none in progress: new, stalled or idle)."""
        return self.conn.their_state in _WAITING

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._forget()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        self.answered += 1
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

    def _evict(self) -> None:
        """Make room for a new connection: one waiting for a request is closed (what it was sent still arrives);
        one with a request in progress, or whose client reads nothing, is dropped at once (its response cut)."""
        if self.waiting() and self._unread is None:
            self._close()
        else:
            self._abort()

    def _abort(self) -> None:
        """Drop a connection whose client reads nothing of its response (closing would wait to send it)."""
        self._forget()
        self.transport.abort()

    def _watch(self) -> None:
        """File the connection by what it is doing; arm the deadline while the client owes a request (from the
        start of the wait), disarm it once the request came."""
        waiting = self.waiting()
        if self._group is not None:
            mine = self.clients[self._client]
            self._file((mine.idle if self.answered else mine.unstarted) if waiting else mine.busy)
        waiting = waiting and not self.transport.is_closing()
        if waiting and self._deadline is None:
            self._deadline = self.loop.call_later(self.request_timeout, self._close)
        elif not waiting and self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _file(self, group: dict[GuardedH11, None]) -> None:
        if group is not self._group:
            if self._group is not None:
                del self._group[self]
            group[self] = None
            self._group = group

    def _close(self) -> None:
        self._forget()
        if not self.transport.is_closing():
            self.transport.close()

    def _forget(self) -> None:
        for timer in (self._deadline, self._unread):
            if timer is not None:
                timer.cancel()
        self._deadline = self._unread = None
        if self._group is not None:
            del self._group[self]
            self._group = None
            if not self.clients[self._client]:
                del self.clients[self._client]


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
