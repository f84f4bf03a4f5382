"""A fault-injecting HTTP server on 127.0.0.1 for download tests: every way the real web fails a fetch.

Routes (``NAME`` is an image registered with :meth:`FaultServer.add_image`):

==========================  ==========================================================================
``/image/NAME``             200 with the image (Content-Type from its format)
``/status/CODE``            that status, a short text body
``/flaky/N/NAME``           503 for the first N requests of this path, then the image
``/ratelimit/S/NAME``       429 with ``Retry-After: S`` on the first request, then the image
``/drip``                   200, Content-Length 1000, then one byte a second (a JPEG's first bytes)
``/reset``                  the connection is reset (RST) once the request is read
``/short/NAME``             Content-Length of the image, half of it sent, then the connection closed
``/html``                   an HTML page served as ``image/jpeg``
``/huge``                   80 MiB with a JPEG signature and no Content-Length (the client must stop it)
``/bomb``                   a valid PNG declaring 20000×20000 pixels (a few hundred bytes)
``/redirect/N/NAME``        a chain of N redirects (302, relative Location), then the image
``/loop``                   a redirect to itself
``/tofile``                 a redirect to ``file:///etc/passwd``
``/noai/NAME``              the image with ``X-Robots-Tag: noai``
``/otherbot/NAME``          the image with ``X-Robots-Tag: otherbot: noai`` (scoped to another agent)
==========================  ==========================================================================

A query string (``?row=3``) is ignored by the routes and makes a URL distinct in the counts.
Every response closes its connection. ``latency=(low, high)`` delays each response by a random time.
The server counts requests per path (``requests``, with their times in ``times``), the most requests in
flight per ``Host`` header (``max_in_flight``) and in all (``max_in_flight_total``), and the bytes
``/huge`` sent (``huge_sent``).
It listens on 127.0.0.1 only and runs in a daemon thread; :meth:`stop` ends it.
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
import zlib
from collections import Counter

HUGE_BYTES = 80 << 20
DRIP_BYTES = 1000
_CONTENT_TYPES = {b"\xff\xd8": "image/jpeg", b"\x89P": "image/png", b"RI": "image/webp", b"GI": "image/gif"}


def png_bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG whose header declares ``width``×``height`` RGB pixels (its data is one compressed row)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\x00" * (3 * width + 1)))
            + chunk(b"IEND", b""))


class FaultServer:
    """The server; ``url(path)`` is the address of a route, ``host`` may replace 127.0.0.1 in it."""

    def __init__(self, latency: tuple[float, float] = (0.0, 0.0), seed: int = 0):
        self.images: dict[str, bytes] = {}
        self.latency = latency
        self.random = random.Random(seed)
        self.requests: Counter[str] = Counter()
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.max_in_flight_total = 0
        self.times: dict[str, list[float]] = {}  # monotonic time of each request, by path
        self.huge_sent = 0
        self.user_agents: set[str] = set()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fault-server")
        self._thread.start()
        if not self._started.wait(10):
            raise RuntimeError("the fault server did not start within 10 s")

    def add_image(self, name: str, data: bytes) -> None:
        self.images[name] = data

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def stop(self) -> None:
        """Close the listening socket, end every response in progress, and end the thread."""
        async def shutdown() -> None:
            self._server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        lines = head.decode("latin-1").split("\r\n")
        path = lines[0].split(" ")[1]
        headers = {name.strip().lower(): value.strip() for name, _, value in
                   (line.partition(":") for line in lines[1:] if line)}
        host = headers.get("host", "").rsplit(":", 1)[0]
        with self._lock:
            self.requests[path] += 1
            self.times.setdefault(path, []).append(time.monotonic())
            count = self.requests[path]
            self.user_agents.add(headers.get("user-agent", ""))
            self.in_flight[host] += 1
            self.max_in_flight[host] = max(self.max_in_flight[host], self.in_flight[host])
            self.max_in_flight_total = max(self.max_in_flight_total, sum(self.in_flight.values()))
            delay = self.random.uniform(*self.latency)
        try:
            if delay:
                await asyncio.sleep(delay)
            await self._respond(path, count, writer)
        except (ConnectionError, OSError, asyncio.CancelledError):  # the client left, or the server stops
            pass
        finally:
            with self._lock:
                self.in_flight[host] -= 1
            writer.close()

    async def _send(self, writer: asyncio.StreamWriter, status: int, body: bytes = b"",
                    headers: dict[str, str] | None = None, length: int | None = -1) -> None:
        fields = {"Connection": "close", **(headers or {})}
        if length is not None:
            fields["Content-Length"] = str(len(body) if length == -1 else length)
        head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
        writer.write(head.encode("latin-1") + body)
        await writer.drain()

    def _image(self, name: str) -> tuple[bytes, dict[str, str]]:
        data = self.images[name]
        return data, {"Content-Type": _CONTENT_TYPES.get(data[:2], "application/octet-stream")}

    async def _respond(self, path: str, count: int, writer: asyncio.StreamWriter) -> None:
        parts = path.split("?")[0].strip("/").split("/")  # a query only makes a URL distinct
        route = parts[0]
        if route == "image":
            await self._send(writer, 200, *self._image(parts[1]))
        elif route == "status":
            await self._send(writer, int(parts[1]), b"error", {"Content-Type": "text/plain"})
        elif route == "flaky" and count <= int(parts[1]):
            await self._send(writer, 503, b"busy", {"Content-Type": "text/plain"})
        elif route == "flaky":
            await self._send(writer, 200, *self._image(parts[2]))
        elif route == "ratelimit" and count == 1:
            await self._send(writer, 429, b"slow down", {"Retry-After": parts[1]})
        elif route == "ratelimit":
            await self._send(writer, 200, *self._image(parts[2]))
        elif route == "drip":
            await self._send(writer, 200, b"", {"Content-Type": "image/jpeg"}, length=DRIP_BYTES)
            for byte in (b"\xff\xd8\xff\xe0" + b"\x00" * DRIP_BYTES)[:60]:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(1)
        elif route == "reset":
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        elif route == "short":
            data, headers = self._image(parts[1])
            await self._send(writer, 200, data[: len(data) // 2], headers, length=len(data))
        elif route == "html":
            await self._send(writer, 200, b"<!doctype html><html><body>Not here</body></html>",
                             {"Content-Type": "image/jpeg"})
        elif route == "huge":
            await self._send(writer, 200, b"", {"Content-Type": "image/jpeg"}, length=None)
            block = b"\xff\xd8\xff\xe0" + bytes((1 << 20) - 4)
            for _ in range(HUGE_BYTES >> 20):
                writer.write(block)
                await writer.drain()
                self.huge_sent += len(block)
                block = bytes(1 << 20)
        elif route == "bomb":
            await self._send(writer, 200, png_bomb(), {"Content-Type": "image/png"})
        elif route == "redirect":
            hops = int(parts[1])
            location = f"/redirect/{hops - 1}/{parts[2]}" if hops > 1 else f"/image/{parts[2]}"
            await self._send(writer, 302, b"", {"Location": location})
        elif route == "loop":
            await self._send(writer, 302, b"", {"Location": "/loop"})
        elif route == "tofile":
            await self._send(writer, 302, b"", {"Location": "file:///etc/passwd"})
        elif route in ("noai", "otherbot"):
            data, headers = self._image(parts[1])
            tag = "noai" if route == "noai" else "otherbot: noai"
            await self._send(writer, 200, data, {**headers, "X-Robots-Tag": tag})
        else:
            await self._send(writer, 404, b"no such route")
