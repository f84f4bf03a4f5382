"""The fetcher: download image URLs concurrently with a total deadline, a byte cap and retries by class.

Built on aiohttp rather than httpx because aiohttp takes a resolver object (``--resolve`` and the tests
map host names to 127.0.0.1 through it, and its connector caches DNS answers), and because its streamed
body reads compose with ``asyncio.timeout`` into one deadline over connect, headers and body; httpx's
timeouts are per socket operation, the very behaviour that lets a dripping body hang a download.

One fetch (:meth:`Fetcher.fetch`) is up to ``1 + retries`` tries, and each try is exactly one request on the
wire per URL it visits (aiohttp's hidden re-send on a dropped connection is turned off), so the ledger's
``attempts`` are the requests a server saw; each try:

1. waits for a slot of the URL's host (``per_host``) and then a global one (``concurrency``);
2. runs under one deadline (``timeout`` seconds) for connecting, every redirect hop, headers and body;
3. follows at most ``max_redirects`` redirects, http(s) only, never the same URL twice;
4. decides from the headers alone: 404/410 → ``not_found``, another error status → ``http_error``,
   ``X-Robots-Tag: noai``/``noimageai`` → ``opted_out`` (unless ``respect_opt_out`` is off), a
   ``Content-Length`` above ``max_bytes`` → ``too_large``; none of these bodies is read;
5. streams the body, checking the first bytes for an image signature (``not_an_image`` at once if
   not) and stopping as soon as it passes ``max_bytes`` (``too_large``).

Transient failures (timeouts, connection errors, DNS, 429 and 5xx) are tried again after an exponential
backoff with jitter, or after the server's ``Retry-After`` when it gives one (a wait longer than
``max_retry_after`` is not waited for); permanent ones never are. :class:`FetchPool` runs a fetcher on an
event loop of its own thread, so synchronous code (a build's sources) submits URLs and waits for results:
uvloop's loop where it is installed (part of the ``urls`` extra; about 8% less CPU per fetch than
asyncio's, measured on ``benchmarks/bench_download.py``'s table), else asyncio's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import hashlib
import random
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from email.utils import parsedate_to_datetime
from types import TracebackType
from urllib.parse import urlsplit

from mmidx import __version__
from mmidx.errors import MissingExtraError
from mmidx.fetch.outcomes import OK, RETRIED_STATUSES, is_transient

try:
    import aiohttp
    from aiohttp.abc import AbstractResolver, ResolveResult
    from aiohttp.resolver import DefaultResolver
    from yarl import URL
except ImportError as error:  # an extra: pip install "mmidx[urls]"
    raise MissingExtraError('downloading URLs needs aiohttp: pip install "mmidx[urls]"') from error

REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 1 << 16
_SIGNATURES = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"GIF87a", b"GIF89a", b"BM", b"II*\x00", b"MM\x00*",
               b"\x00\x00\x00\x0cjP  \r\n\x87\n", b"\xff\x4f\xff\x51")
_SIGNATURE_BYTES = 12
_VALUED_RULES = frozenset({"unavailable_after", "max-snippet", "max-image-preview", "max-video-preview"})


def is_image_signature(head: bytes) -> bool:
    """Whether ``head`` (at least 12 bytes, or the whole body) starts like an image format mmidx stores."""
    return head.startswith(_SIGNATURES) or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")


@dataclass(frozen=True)
class FetchSettings:
    """How to fetch: limits, retries and who we say we are (see the module docstring)."""

    concurrency: int = 64
    per_host: int = 16
    timeout: float = 20.0
    max_bytes: int = 32 << 20
    max_redirects: int = 5
    retries: int = 2
    backoff: float = 0.5  # seconds before the first retry; doubled each time, plus up to as much jitter
    max_retry_after: float = 60.0
    respect_opt_out: bool = True
    user_agent_token: str = ""
    hosts: Mapping[str, str] = field(default_factory=dict)  # host name → address, before DNS (curl's --resolve)

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.per_host < 1:
            raise ValueError(f"fetch concurrency and per-host cap must be at least 1, not {self.concurrency} "
                             f"and {self.per_host}")
        if not self.timeout > 0 or self.max_bytes < 1 or self.retries < 0 or self.max_redirects < 0:
            raise ValueError("need timeout > 0, max_bytes >= 1, retries >= 0 and max_redirects >= 0")

    @property
    def user_agent(self) -> str:
        """``mmidx/VERSION (+TOKEN)``: names mmidx, and the user's token so sites can tell whose crawl it is."""
        token = f" (+{self.user_agent_token})" if self.user_agent_token else ""
        return f"mmidx/{__version__}{token}"


@dataclass(frozen=True)
class FetchResult:
    """How one URL's fetch ended: ``outcome`` is ``"ok"`` or a class of :data:`mmidx.fetch.outcomes.OUTCOMES`."""

    url: str
    outcome: str
    status: int | None = None  # the last HTTP status received
    body: bytes | None = None  # the body as served, when the outcome is ok
    attempts: int = 0
    detail: str = ""
    opted_out: bool = False  # the server opted out and respect_opt_out was off: fetched anyway
    retry_after: float | None = None  # the server's Retry-After, in seconds

    @property
    def sha256(self) -> str | None:
        return None if self.body is None else hashlib.sha256(self.body).hexdigest()


def _opted_out(values: list[str], agents: tuple[str, ...]) -> bool:
    """Whether ``X-Robots-Tag`` values say noai/noimageai for every agent or for one of ``agents``.

    A value is a comma-separated list of rules, each optionally scoped to an agent (``otherbot: noai``);
    rules that take a value (``max-snippet: 20``) are not scopes.
    """
    for value in values:
        scope = None
        for part in value.split(","):
            name, colon, rest = part.partition(":")
            name = name.strip().lower()
            if colon and name and " " not in name and name not in _VALUED_RULES:
                scope, part = name, rest
            if part.strip().lower() in ("noai", "noimageai") and (scope is None or scope in agents):
                return True
    return False


def _retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks to wait (delta-seconds or an HTTP date), None if absent or bad."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, (parsedate_to_datetime(value) - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    except (TypeError, ValueError):
        return None


class MappedResolver(AbstractResolver):
    """DNS with some host names pinned to addresses (tests, curl's ``--resolve``); others resolved normally."""

    def __init__(self, hosts: Mapping[str, str]):
        self.hosts = {name.lower(): address for name, address in hosts.items()}
        self.fallback = DefaultResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        address = self.hosts.get(host.lower())
        if address is None:
            return await self.fallback.resolve(host, port, family)
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [ResolveResult(hostname=host, host=address, port=port, family=family, proto=0,
                              flags=socket.AI_NUMERICHOST)]

    async def close(self) -> None:
        await self.fallback.close()


class Fetcher:
    """Fetches URLs on the running event loop; open it with ``async with`` (one HTTP session inside)."""

    def __init__(self, settings: FetchSettings):
        self.settings = settings
        self.agents = ("mmidx", *((settings.user_agent_token.lower(),) if settings.user_agent_token else ()))
        self._session: aiohttp.ClientSession | None = None
        self._slots: asyncio.Semaphore | None = None
        self._host_slots: dict[str, asyncio.Semaphore] = {}

    async def __aenter__(self) -> Fetcher:
        resolver = MappedResolver(self.settings.hosts)
        connector = aiohttp.TCPConnector(limit=self.settings.concurrency, limit_per_host=0, ttl_dns_cache=300,
                                         resolver=resolver)
        self._session = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None),
                                              cookie_jar=aiohttp.DummyCookieJar(),
                                              headers={"User-Agent": self.settings.user_agent},
                                              max_line_size=16384, max_field_size=16384)
        # aiohttp sends an idempotent request a second time, unseen, when its connection drops before the
        # response (RFC 9112's retry of a closed keep-alive connection): the server then sees two requests
        # for one try, which the host's politeness budget and the ledger's attempts would not count. Every
        # request on the wire must be a try of ours, so that retry is off (aiohttp's own test client does
        # the same; there is no public switch) and our retry loop, which counts and backs off, is the only one.
        self._session._retry_connection = False
        self._slots = asyncio.Semaphore(self.settings.concurrency)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    async def fetch(self, url: str) -> FetchResult:
        """Fetch ``url`` with retries; never raises for anything the network or the server does."""
        try:
            parts = urlsplit(url)
            valid = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            valid = False
        if not valid:
            return FetchResult(url, "invalid_url", detail=f"not an absolute http(s) URL: {url[:200]!r}")
        host = parts.hostname.lower()
        attempts = 0
        while True:
            attempts += 1
            result = replace(await self._try(url, host), attempts=attempts)
            if result.outcome == OK or not is_transient(result.outcome, result.status) \
                    or attempts > self.settings.retries:
                return result
            delay = self.settings.backoff * 2 ** (attempts - 1)
            if result.retry_after is not None:
                if result.retry_after > self.settings.max_retry_after:
                    return replace(result, detail=f"{result.detail}; Retry-After {result.retry_after:.0f} s is "
                                                  f"longer than the {self.settings.max_retry_after:.0f} s waited for")
                delay = result.retry_after
            await asyncio.sleep(delay + random.uniform(0, self.settings.backoff))

    def _host_slot(self, host: str) -> asyncio.Semaphore:
        if host not in self._host_slots:
            self._host_slots[host] = asyncio.Semaphore(self.settings.per_host)
        return self._host_slots[host]

    async def _try(self, url: str, host: str) -> FetchResult:
        """One try under the deadline, holding a slot of ``host`` and a global one (in that order)."""
        async with self._host_slot(host), self._slots:
            try:
                async with asyncio.timeout(self.settings.timeout):
                    return await self._follow(url)
            except TimeoutError:
                return FetchResult(url, "timeout", detail=f"no whole response within {self.settings.timeout:g} s")
            except aiohttp.ClientConnectorDNSError as error:
                return FetchResult(url, "dns", detail=str(error)[:300])
            except aiohttp.InvalidURL as error:
                return FetchResult(url, "invalid_url", detail=f"invalid URL: {error}")
            except (aiohttp.ClientError, OSError, ValueError, EOFError) as error:  # resets, short bodies, bad HTTP
                return FetchResult(url, "connection", detail=f"{type(error).__name__}: {error}"[:300])

    async def _follow(self, url: str) -> FetchResult:
        """Request ``url`` and follow its redirects (http(s) only, no URL twice, at most ``max_redirects``)."""
        seen = {url}
        current = URL(url, encoded=True)
        for _ in range(self.settings.max_redirects + 1):
            async with self._session.get(current, allow_redirects=False) as response:
                if response.status not in REDIRECT_STATUSES:
                    return await self._read(url, response)
                location = response.headers.get("Location")
                if not location:
                    return FetchResult(url, "http_error", response.status, detail="redirect without a Location")
                target = current.join(URL(location))
                if target.scheme not in ("http", "https"):
                    return FetchResult(url, "redirects", response.status,
                                       detail=f"redirect to a {target.scheme or 'relative'} URL refused: "
                                              f"{location[:200]}")
                if str(target) in seen:
                    return FetchResult(url, "redirects", response.status, detail=f"redirect loop at {target}")
                seen.add(str(target))
                current = target
        return FetchResult(url, "redirects", response.status,
                           detail=f"more than {self.settings.max_redirects} redirects")

    async def _read(self, url: str, response: aiohttp.ClientResponse) -> FetchResult:
        """The outcome of a final (non-redirect) response: decided from headers first, then the body."""
        status = response.status
        if status in (404, 410):
            return FetchResult(url, "not_found", status, detail=f"HTTP {status}")
        if not 200 <= status < 300:
            wait = _retry_after(response.headers.get("Retry-After")) if status in RETRIED_STATUSES else None
            return FetchResult(url, "http_error", status, detail=f"HTTP {status} {response.reason or ''}".strip(),
                               retry_after=wait)
        opted_out = _opted_out(response.headers.getall("X-Robots-Tag", []), self.agents)
        if opted_out and self.settings.respect_opt_out:
            return FetchResult(url, "opted_out", status, detail="X-Robots-Tag: " +
                               ", ".join(response.headers.getall("X-Robots-Tag")))
        limit = self.settings.max_bytes
        if response.content_length is not None and response.content_length > limit:
            return FetchResult(url, "too_large", status,
                               detail=f"Content-Length {response.content_length} above {limit} bytes")
        body = bytearray()
        checked = False
        async for chunk in response.content.iter_chunked(_CHUNK):
            body += chunk
            if len(body) > limit:
                return FetchResult(url, "too_large", status, detail=f"body above {limit} bytes (stopped reading)")
            if not checked and len(body) >= _SIGNATURE_BYTES:
                if not is_image_signature(bytes(body[:_SIGNATURE_BYTES])):
                    return _not_an_image(url, status, response, body)
                checked = True
        if not checked and not is_image_signature(bytes(body)):
            return _not_an_image(url, status, response, body)
        return FetchResult(url, OK, status, bytes(body), opted_out=opted_out)


def _not_an_image(url: str, status: int, response: aiohttp.ClientResponse, body: bytearray) -> FetchResult:
    return FetchResult(url, "not_an_image", status, detail=f"Content-Type {response.content_type!r}, body "
                                                           f"starts {bytes(body[:16])!r}")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop if uvloop is installed, else asyncio's (same behaviour, less CPU per fetch).

    uvloop's ``sock_connect`` (aiohttp connects every socket through it, to an address already resolved)
    looks the address up again with ``self.getaddrinfo(host, port, family=...)``: without a socket type,
    that misses uvloop's shortcut for numeric addresses and goes through libuv's thread pool, a round trip
    to another thread for every connection. This loop's ``getaddrinfo`` asks for stream sockets when no
    type is given (the loop serves only the fetcher, whose sockets are all TCP), so a numeric address is
    answered at once (``benchmarks/bench_download.py``).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop = uvloop.new_event_loop()
    lookup = loop.getaddrinfo

    async def getaddrinfo(host: object, port: object, *, family: int = 0, type: int = 0, proto: int = 0,
                          flags: int = 0) -> list:
        return await lookup(host, port, family=family, type=type or socket.SOCK_STREAM, proto=proto, flags=flags)

    loop.getaddrinfo = getaddrinfo  # an attribute of this loop, so uvloop's sock_connect calls it
    return loop


class FetchPool:
    """A :class:`Fetcher` on an event loop of its own thread: ``submit(url)`` returns a concurrent future.

    Use it as a context manager; leaving it cancels fetches still running and closes the session.
    """

    def __init__(self, settings: FetchSettings):
        self.settings = settings
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mmidx-fetch", daemon=True)
        self._fetcher = Fetcher(settings)

    def __enter__(self) -> FetchPool:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._fetcher.__aenter__(), self._loop).result()
        return self

    def submit(self, url: str) -> concurrent.futures.Future[FetchResult]:
        """Start fetching ``url``; the future's result is its :class:`FetchResult`."""
        return asyncio.run_coroutine_threadsafe(self._fetcher.fetch(url), self._loop)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        async def close() -> None:
            current = asyncio.current_task()
            tasks = [task for task in asyncio.all_tasks() if task is not current]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._fetcher.__aexit__()

        try:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()

