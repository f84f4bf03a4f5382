"""The viewer's web application: routes from URLs to pages, images and errors (Starlette, served by uvicorn).

Why Starlette and uvicorn: a small ASGI toolkit with no template engine, ORM or build step to carry,
routing with typed path parameters (``{index:mmidx_number}`` only matches digits), a test client, and a
server that binds one socket; aiohttp would do as well but brings its own server and client
stack. Pages are rendered in Python (:mod:`mmidx.toolkit.view.pages`), with no script.

Safety: a URL names a dataset by its catalog name and samples, images and packs by numbers; no part
of a URL is ever used as a path, so ``..`` (raw or percent-encoded) can only miss a route or a name
and get the 404 page. Every response is bounded in size (pagination, cut texts, image limits) and in
time: work runs in a pool of ``WORKERS`` threads (a real cap: work is never abandoned to a thread outside it),
a request whose work takes more than ``TIME_LIMIT`` seconds is answered 503, its work goes on in the pool and
its result is kept for the next request of the same URL (a reload), while work that had not started is dropped.
Numbers in paths have at most 18 digits (longer is a 404). Errors are one-line HTML pages, never a traceback.
Slow clients, the Host check and the security headers are :mod:`mmidx.toolkit.view.guard`'s.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mmidx.errors import MissingExtraError

try:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.convertors import Convertor, register_url_convertor
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import HTMLResponse, Response
    from starlette.routing import Route
except ImportError as error:  # the optional web stack
    raise MissingExtraError('mmidx view needs Starlette and uvicorn: pip install "mmidx[view]"') from error

from mmidx import format as fmt
from mmidx.format import FormatError
from mmidx.index.mixture import mixture_report
from mmidx.read.encoding_streams import describe, encoding_names
from mmidx.toolkit.sample import describe_sample
from mmidx.toolkit.view import pages
from mmidx.toolkit.view.catalog import Catalog, PacksUnavailable
from mmidx.toolkit.view.guard import Front, guarded_protocol
from mmidx.toolkit.view.limits import KEEP_ALIVE, PER_CLIENT, REQUEST_TIMEOUT, TIME_LIMIT, WORKERS
from mmidx.toolkit.view.markup import STYLE, dataset_url, sample_url
from mmidx.toolkit.view.packs import pack_layout
from mmidx.toolkit.view.search import search_texts
from mmidx.toolkit.view.stats import integer_histogram
from mmidx.toolkit.view.thumbs import MAX_SIDE, ImageCache, browser_image, served_as_stored, thumbnail
from mmidx.toolkit.view.workers import Refused, Workers, error_response

SAMPLES_PER_PAGE = 48
PACKS_PER_PAGE = 100
CAPTION_CHARS = 160
MAX_QUERY = 200
MAX_ENCODED_PAYLOADS = 8
MAX_LAYOUTS = 64
MAX_DIGITS = 18
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


def _number(text: str | None, what: str, default: int = 0) -> int:
    """A non-negative integer query parameter; anything else is a 404 (as a bad number in the path is)."""
    if text is None:
        return default
    if not text.isascii() or not text.isdigit() or len(text) > MAX_DIGITS:
        raise Refused(404, f"{what} {text[:40]!r} is not a page or sample number")
    return int(text)


class _Number(Convertor[int]):
    """A path number of at most ``MAX_DIGITS`` ASCII digits: a longer one matches no route (404), where
    Starlette's ``int`` would hand 4,300 digits and more to ``int()`` and fail with a 500."""

    regex = f"[0-9]{{1,{MAX_DIGITS}}}"

    def convert(self, value: str) -> int:
        return int(value)

    def to_string(self, value: int) -> str:
        return str(value)


register_url_convertor("mmidx_number", _Number())


class Viewer:
    """The routes' work over one catalog; every method runs in a worker thread and returns a Response."""

    def __init__(self, catalog: Catalog):
        self.catalog = catalog
        self.images = ImageCache()
        self._layouts: OrderedDict[int, Any] = OrderedDict()
        self._pack_lock = threading.Lock()

    def entry(self, name: str) -> Any:
        try:
            return self.catalog[name]
        except KeyError:
            raise Refused(404, f"no dataset called {name[:80]!r} is served here") from None

    def sample(self, name: str, index: int) -> Any:
        dataset = self.entry(name).dataset
        if not 0 <= index < len(dataset):
            raise Refused(404, f"sample {index} out of range: {name} has {len(dataset):,} samples")
        return dataset[index]

    def overview(self, request: Request) -> Response:
        overviews = {name: self.catalog.overview(name) for name in self.catalog.datasets}
        entries = [(entry, overviews[name], self.catalog.structure(name))  # checks start after the overviews
                   for name, entry in self.catalog.datasets.items()]
        return HTMLResponse(pages.overview_page(entries, self.catalog.packs_note, self.catalog.config is not None))

    @staticmethod
    def _caption(sample: Any, tokenizer: Any) -> str:
        """The first text of the sample's first view (its caption or prompt), cut to ``CAPTION_CHARS``."""
        payloads = [int(record["payload"]) for record in sample.elements(0) if record["kind"] == fmt.TEXT]
        if not payloads:
            return ""
        ids = sample.text(payloads[0])
        head = ids[:CAPTION_CHARS]  # decode only the head, however long the text
        text = tokenizer.decode(head) if tokenizer is not None else " ".join(map(str, head.tolist()))
        return text[:CAPTION_CHARS] + ("…" if len(ids) > CAPTION_CHARS or len(text) > CAPTION_CHARS else "")

    def samples(self, request: Request) -> Response:
        name = request.path_params["name"]
        entry = self.entry(name)
        total = len(entry.dataset)
        count = max(1, math.ceil(total / SAMPLES_PER_PAGE))
        number = _number(request.query_params.get("page"), "page")
        if number >= count:
            raise Refused(404, f"page {number} out of range: {name} has {count:,} pages of samples")
        tokenizer, _ = self.catalog.tokenizer(name)
        cells = []
        for index in range(number * SAMPLES_PER_PAGE, min(total, (number + 1) * SAMPLES_PER_PAGE)):
            sample = entry.dataset[index]
            thumb = dataset_url(name, f"sample/{index}/thumb/0") if sample.num_images else None
            cells.append((index, thumb, self._caption(sample, tokenizer)))
        return HTMLResponse(pages.samples_page(entry, number, count, cells, total))

    def search(self, request: Request) -> Response:
        name = request.path_params["name"]
        entry = self.entry(name)
        query = request.query_params.get("q", "").strip()
        if len(query) > MAX_QUERY:
            raise Refused(400, f"the search text is {len(query)} characters long; at most {MAX_QUERY}")
        start = _number(request.query_params.get("start"), "start")
        tokenizer, why_not = self.catalog.tokenizer(name)
        if not query:
            return HTMLResponse(pages.search_page(entry, None, None))
        if tokenizer is None:
            return HTMLResponse(pages.search_page(entry, None, f"search decodes texts and needs the tokenizer: "
                                                                f"{why_not}"))
        return HTMLResponse(pages.search_page(entry, search_texts(entry.dataset, tokenizer, query, start), None))

    def _encodings(self, entry: Any, sample: Any) -> list[str]:
        lines = []
        for name in encoding_names(entry.prefix):
            try:
                info = self.catalog.cached(("encoding", entry.name, name), lambda n=name: describe(entry.dataset, n))
                count = sample.num_texts if info["modality"] == "text" else sample.num_images
                shapes = [tuple(sample.encoding(name, payload).shape)
                          for payload in range(min(count, MAX_ENCODED_PAYLOADS))]
                more = f" (first {MAX_ENCODED_PAYLOADS} of {count})" if count > MAX_ENCODED_PAYLOADS else ""
                lines.append(f"{name}: {info['modality']} encoding by {info['encoder']} ({info['dtype']}, "
                             f"{info['store']}); this sample's records{more}: "
                             + (", ".join(str(shape) for shape in shapes) or "none"))
            except (FormatError, ValueError, IndexError, OSError) as error:
                lines.append(f"{name}: cannot be read ({error})")
        return lines

    def sample_page(self, request: Request) -> Response:
        name, index = request.path_params["name"], request.path_params["index"]
        entry = self.entry(name)
        sample = self.sample(name, index)
        tokenizer = self.catalog.tokenizer(name)
        views = [describe_sample(entry.dataset, index, view=view, tokenizer=tokenizer,
                                 max_text_tokens=pages.MAX_TEXT_TOKENS)
                 for view in range(min(sample.num_views, pages.MAX_VIEWS))]
        images = []
        for j, record in enumerate(sample.images):
            served = "shown as stored" if served_as_stored(record) else \
                f"shown re-encoded as PNG (at most {MAX_SIDE} pixels a side): browsers do not show it as stored"
            images.append((dataset_url(name, f"sample/{index}/image/{j}"),
                           dataset_url(name, f"sample/{index}/thumb/{j}"), served))
        samples_url = dataset_url(name, page=index // SAMPLES_PER_PAGE)
        return HTMLResponse(pages.sample_page(entry, views, images, self._encodings(entry, sample), samples_url))

    def _record(self, request: Request) -> tuple[Any, Any]:
        name, index, j = (request.path_params[key] for key in ("name", "index", "image"))
        sample = self.sample(name, index)
        if not 0 <= j < sample.num_images:
            raise Refused(404, f"image {j} out of range: sample {index} of {name} has {sample.num_images} images")
        return (name, index, j), sample.image(j)

    def image(self, request: Request) -> Response:
        key, record = self._record(request)
        if served_as_stored(record):
            data, media_type = browser_image(record)
        else:
            data, media_type = self.images.get(("full", *key), lambda: browser_image(record))
        return Response(bytes(data), media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    def thumb(self, request: Request) -> Response:
        key, record = self._record(request)
        data, media_type = self.images.get(("thumb", *key), lambda: thumbnail(record))
        return Response(data, media_type=media_type, headers={"Cache-Control": "max-age=3600"})

    def _packs(self) -> Any:
        try:
            return self.catalog.pack_index()
        except PacksUnavailable as error:
            raise Refused(404, str(error)) from None

    def packs(self, request: Request) -> Response:
        packs = self._packs()
        total = len(packs.index)
        count = max(1, math.ceil(total / PACKS_PER_PAGE))
        number = _number(request.query_params.get("page"), "page")
        if number >= count:
            raise Refused(404, f"page {number} out of range: there are {count:,} pages of packs")
        maximum = packs.index.config.packing.max_num_tokens
        fill = self.catalog.cached("pack_fill", lambda: integer_histogram(
            "pack fill (planned tokens, % of max_num_tokens)", packs.tokens * 100 // maximum))
        offsets = packs.index.arrays["pack_offsets"]
        rows = [(k, int(offsets[k + 1]) - int(offsets[k]), int(packs.tokens[k]))
                for k in range(number * PACKS_PER_PAGE, min(total, (number + 1) * PACKS_PER_PAGE))]
        mixture = self.catalog.cached("mixture", lambda: pages.mixture_section(mixture_report(packs.index))) \
            if number == 0 else ""
        return HTMLResponse(pages.packs_page(packs.index.stats, rows, maximum, number, count, fill,
                                             self.catalog.packs_note, mixture))

    def pack(self, request: Request) -> Response:
        packs = self._packs()
        k = request.path_params["pack"]
        if not 0 <= k < len(packs.index):
            raise Refused(404, f"pack {k} out of range: the index has {len(packs.index):,} packs")
        with self._pack_lock:  # PackBuilder keeps per-build state: one pack at a time
            layout = self._layouts.get(k)
            if layout is None:
                layout = pack_layout(packs, k, self.catalog.pack_names, sample_url)
                self._layouts[k] = layout
                while len(self._layouts) > MAX_LAYOUTS:
                    self._layouts.popitem(last=False)
            self._layouts.move_to_end(k)
        return HTMLResponse(pages.pack_page(layout, len(packs.index)))


def create_app(catalog: Catalog, *, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
               time_limit: float = TIME_LIMIT, workers: int = WORKERS) -> Front:
    """The viewer of ``catalog`` as an ASGI app. Requests whose Host header is not in ``allowed_hosts``
    are refused (a page on another site cannot reach a loopback viewer by DNS rebinding); ``["*"]``
    allows any (for ``--host`` other than loopback). Page work runs in ``workers`` threads and is answered
    503 after ``time_limit`` seconds (:class:`Workers`)."""
    viewer = Viewer(catalog)
    pool = Workers(workers, time_limit)

    def route(path: str, work: Callable[[Request], Response]) -> Route:
        async def endpoint(request: Request) -> Response:
            return await pool.answer(work, request)

        return Route(path, endpoint, methods=["GET", "HEAD"])

    async def style(request: Request) -> Response:
        return Response(STYLE, media_type="text/css", headers={"Cache-Control": "max-age=3600"})

    async def http_error(request: Request, error: HTTPException) -> Response:
        message = {404: "not found: nothing is served at this address",
                   405: "method not allowed: the viewer is read-only"}.get(error.status_code, str(error.detail))
        return error_response(error.status_code, message)

    async def server_error(request: Request, error: Exception) -> Response:  # a bug: Front logs it in one line
        return error_response(500, f"internal error {type(error).__name__}: {str(error)[:200]}")

    routes = [
        route("/", viewer.overview),
        Route("/style.css", style, methods=["GET", "HEAD"]),
        route("/dataset/{name}", viewer.samples),
        route("/dataset/{name}/samples", viewer.samples),
        route("/dataset/{name}/search", viewer.search),
        route("/dataset/{name}/sample/{index:mmidx_number}", viewer.sample_page),
        route("/dataset/{name}/sample/{index:mmidx_number}/image/{image:mmidx_number}", viewer.image),
        route("/dataset/{name}/sample/{index:mmidx_number}/thumb/{image:mmidx_number}", viewer.thumb),
        route("/packs", viewer.packs),
        route("/pack/{pack:mmidx_number}", viewer.pack),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error})
    return Front(app, allowed_hosts, error_response)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is reachable from this machine only."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (port 0: any free one), made before the server starts so the
    printed URL names the real port and answers as soon as it is printed."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)  # connections wait in the backlog from now on, before the server's loop runs
    except OSError:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    """The http URL a bound socket answers at."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"


def _server(app: Front, *, request_timeout: float, keep_alive: float, per_client: int) -> uvicorn.Server:
    """uvicorn serving ``app`` with :mod:`mmidx.toolkit.view.guard`'s protocol: requests must arrive whole within
    ``request_timeout`` s, idle keep-alive connections close after ``keep_alive`` s, ``per_client`` connections
    per client (every loopback address is one), heads of at most ``MAX_HEAD`` bytes."""
    config = uvicorn.Config(app, http=guarded_protocol(request_timeout, per_client), log_level="warning",
                            access_log=False, timeout_keep_alive=keep_alive, limit_concurrency=4 * per_client,
                            timeout_graceful_shutdown=2)
    return uvicorn.Server(config)


def serve(catalog: Catalog, sock: socket.socket, *, time_limit: float = TIME_LIMIT,
          request_timeout: float = REQUEST_TIMEOUT, keep_alive: float = KEEP_ALIVE,
          per_client: int = PER_CLIENT) -> None:
    """Serve ``catalog`` on ``sock`` until interrupted (Ctrl-C), warming its overviews, tokenizers and
    pack index in a thread meanwhile. The limits are :func:`create_app`'s and :func:`_server`'s."""
    host = sock.getsockname()[0]
    allowed = [*LOOPBACK_HOSTS, host] if is_loopback(host) else ["*"]
    app = create_app(catalog, allowed_hosts=allowed, time_limit=time_limit)
    threading.Thread(target=catalog.warm, name="mmidx-view-warm", daemon=True).start()
    _server(app, request_timeout=request_timeout, keep_alive=keep_alive, per_client=per_client).run(sockets=[sock])


@contextmanager
def serving(catalog: Catalog, host: str = "127.0.0.1", port: int = 0, *, time_limit: float = TIME_LIMIT,
            request_timeout: float = REQUEST_TIMEOUT, keep_alive: float = KEEP_ALIVE,
            per_client: int = PER_CLIENT) -> Iterator[str]:
    """Serve ``catalog`` from a thread of this process while the ``with`` block runs; yields the URL.

    For notebooks, tests and scripts (``tools/screenshots.py``): ``mmidx view`` is the same server in
    the foreground, with the same limits. The pack index and overviews are computed on first request, not warmed."""
    sock = bind(host, port)
    app = create_app(catalog, allowed_hosts=[*LOOPBACK_HOSTS, host], time_limit=time_limit)
    server = _server(app, request_timeout=request_timeout, keep_alive=keep_alive, per_client=per_client)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="mmidx-view", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError(f"the viewer's server did not start on {url_of(sock)}")
            thread.join(0.01)
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
