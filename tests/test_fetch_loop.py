"""The fetcher's event loop: uvloop's, with socket-address lookups that stay on the loop's thread."""

from __future__ import annotations

import socket

import pytest

from mmidx.fetch.client import new_event_loop

uvloop = pytest.importorskip("uvloop")


def test_the_fetch_loop_is_uvloops_and_looks_up_a_numeric_address_as_a_stream_socket_at_once():
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
        answers = loop.run_until_complete(loop.getaddrinfo("127.0.0.1", 8080))
        assert answers == [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 8080))]
    finally:
        loop.close()


def test_sock_connect_on_the_fetch_loop_goes_through_its_lookup_and_connects():
    loop = new_event_loop()
    server = socket.create_server(("127.0.0.1", 0))
    lookups = []
    lookup = loop.getaddrinfo

    async def counted(host, port, **kwargs):
        lookups.append((host, port, kwargs.get("type", 0)))
        return await lookup(host, port, **kwargs)

    loop.getaddrinfo = counted
    client = socket.socket()
    client.setblocking(False)
    try:
        loop.run_until_complete(loop.sock_connect(client, server.getsockname()))
        accepted, _ = server.accept()
        accepted.close()
        assert client.getpeername() == server.getsockname()
        assert lookups == [("127.0.0.1", server.getsockname()[1], 0)]
    finally:
        client.close()
        server.close()
        loop.close()


def test_a_host_name_still_resolves_on_the_fetch_loop():
    loop = new_event_loop()
    try:
        answers = loop.run_until_complete(loop.getaddrinfo("localhost", 80, family=socket.AF_INET))
        assert answers and all(kind == socket.SOCK_STREAM and address[0].startswith("127.")
                               for _, kind, _, _, address in answers)
    finally:
        loop.close()
