"""Hostile local clients of a viewer: stalled connections and pipelined floods, bounded in count and in time.

In this process: :func:`stall` opens stalled connections, :func:`closed_within` counts those the server closed,
:func:`flooding` runs a flood in another process while a ``with`` block runs.

As a process of its own (``python tests/support/floods.py …``), one hostile local program that runs for
``SECONDS``, or until a line or the end of its standard input, printing ``ready`` once each of its connections
has been opened and, at its end, ``opened N answered M`` (connections opened, reopenings included; responses
that began):

- ``stall PORT SECONDS PER_SOURCE SOURCE…``: from each source address (``127.0.0.2``…), ``PER_SOURCE``
  connections that each send the first line of a request and then nothing; one the server closes is opened
  again, so the flood keeps its count;
- ``pipeline PORT SECONDS CONNECTIONS DEPTH PATH``: ``CONNECTIONS`` connections from ``127.0.0.1`` that each
  keep ``DEPTH`` ordinary requests for ``PATH`` pipelined ahead of the responses they read; one the server
  closes or resets is opened again.
"""

from __future__ import annotations

import asyncio
import os
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

HOST = "127.0.0.1"
OTHER_LOOPBACK = ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"]


def loopback_aliases() -> bool:
    """Whether this machine's loopback has addresses besides 127.0.0.1 (Linux: all of 127.0.0.0/8)."""
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.2", 0))
        except OSError:
            return False
    return True


@contextmanager
def flooding(url: str, kind: str, *args: object, seconds: float = 90) -> Iterator[dict[str, int]]:
    """A flood of ``url`` (``kind`` and ``args`` as on the command line) in a process of its own while the block
    runs, every one of its connections opened once when the block starts, stopped when it ends (or after
    ``seconds``). The dict it yields gets the flood's counts, ``opened`` and ``answered``, when the block ends."""
    port = url.split("//")[1].strip("/").rsplit(":", 1)[1]
    process = subprocess.Popen([sys.executable, __file__, kind, port, str(seconds), *map(str, args)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    counts: dict[str, int] = {}
    try:
        if process.stdout.readline().strip() != "ready":
            process.kill()
            raise RuntimeError(f"the flood did not start: {process.communicate()[1][-2000:]}")
        yield counts
    finally:
        try:
            out, err = process.communicate("", timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        words = out.split()
        if process.returncode != 0 or words[:1] != ["opened"]:
            raise RuntimeError(f"the flood failed: {err[-2000:]}")
        counts.update(opened=int(words[1]), answered=int(words[3]))


def stall(url: str, count: int, source: str = "") -> list[socket.socket]:
    """``count`` connections to ``url`` (from ``source``, if given) that each send the first line of a request
    and then nothing."""
    host, port = url.split("//")[1].strip("/").rsplit(":", 1)
    sockets = []
    for _ in range(count):
        connection = socket.create_connection((host.strip("[]"), int(port)), timeout=5,
                                              source_address=(source, 0) if source else None)
        connection.sendall(b"GET / HTTP/1.1\r\n")
        sockets.append(connection)
    return sockets


def closed_within(sockets: list[socket.socket], seconds: float) -> int:
    """How many of ``sockets`` the server closed (EOF or reset) within ``seconds``."""
    selector = selectors.DefaultSelector()
    for connection in sockets:
        connection.setblocking(False)
        selector.register(connection, selectors.EVENT_READ)
    closed, deadline = 0, time.monotonic() + seconds
    while closed < len(sockets) and (left := deadline - time.monotonic()) > 0:
        for key, _ in selector.select(left):
            try:
                data = key.fileobj.recv(1 << 16)
            except ConnectionError:
                data = b""
            if not data:
                selector.unregister(key.fileobj)
                closed += 1
    selector.close()
    return closed


@dataclass
class _Counts:
    opened: int = 0
    answered: int = 0


async def _connect(port: int, source: str, counts: _Counts) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket()
    sock.setblocking(False)
    try:
        sock.bind((source, 0))
        await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    except OSError:
        sock.close()
        raise
    counts.opened += 1
    return await asyncio.open_connection(sock=sock)


async def _stalled(port: int, source: str, until: float, opened: asyncio.Event, counts: _Counts) -> None:
    """One stalled connection from ``source``, opened again whenever the server closes it, until ``until``."""
    while time.monotonic() < until:
        try:
            reader, writer = await _connect(port, source, counts)
            writer.write(b"GET / HTTP/1.1\r\n")
            opened.set()
            try:
                await asyncio.wait_for(reader.read(), max(0.01, until - time.monotonic()))  # returns when closed
            finally:
                writer.close()
        except (OSError, TimeoutError):
            await asyncio.sleep(0.01)


async def _pipelined(port: int, path: str, depth: int, until: float, opened: asyncio.Event, counts: _Counts) -> None:
    """One connection keeping ``depth`` requests ahead of the responses it reads, opened again when closed."""
    request = f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()
    while time.monotonic() < until:
        try:
            reader, writer = await _connect(port, HOST, counts)
            opened.set()
            try:
                writer.write(request * depth)
                tail = b""
                while data := await asyncio.wait_for(reader.read(1 << 16), max(0.01, until - time.monotonic())):
                    answered = (tail + data).count(b"HTTP/1.1 ")
                    counts.answered += answered
                    tail = data[-8:]
                    writer.write(request * answered)  # a new request for each response begun: the depth is kept
            finally:
                writer.close()
        except (OSError, TimeoutError):
            await asyncio.sleep(0.01)


async def _flood(kind: str, port: int, seconds: float, args: list[str]) -> None:
    until, counts = time.monotonic() + seconds, _Counts()
    if kind == "stall":
        count, sources = int(args[0]), args[1:]
        jobs = [(_stalled, (port, source, until)) for source in sources for _ in range(count)]
    else:
        count, depth, path = int(args[0]), int(args[1]), args[2]
        jobs = [(_pipelined, (port, path, depth, until))] * count
    events = [asyncio.Event() for _ in jobs]
    tasks = [asyncio.create_task(job(*job_args, event, counts))
             for (job, job_args), event in zip(jobs, events, strict=True)]
    await asyncio.wait_for(asyncio.gather(*(event.wait() for event in events)), seconds)
    print("ready", flush=True)
    told = asyncio.Event()  # a line on standard input, or its end, stops the flood before its time
    asyncio.get_running_loop().add_reader(sys.stdin.fileno(), told.set)
    flooding = asyncio.gather(*tasks)
    await asyncio.wait([flooding, asyncio.create_task(told.wait())], return_when=asyncio.FIRST_COMPLETED)
    print(f"opened {counts.opened} answered {counts.answered}", flush=True)
    if told.is_set():  # at once: ending a thousand connections one by one takes a loaded machine a minute
        os._exit(0)


if __name__ == "__main__":
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # a socket per connection, over 1,024 for ``stall``
    asyncio.run(_flood(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4:]))
