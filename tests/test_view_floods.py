"""mmidx view fair to its user under other local clients (issue 44): every loopback address is one client, and a
new connection always gets in, making room with an idle keep-alive, else the oldest connection that has sent no
request (while those are over half), else the busiest. The floods are other processes on 127.0.0.1-127.0.0.5,
bounded in connections and in time; the user's probes are new connections from 127.0.0.1."""

import re
import socket
import threading
import time

import httpx
import pytest
from support.floods import OTHER_LOOPBACK, closed_within, flooding, loopback_aliases, stall
from support.view_data import build_planted_dataset

from mmidx.toolkit.view.app import Viewer, serving
from mmidx.toolkit.view.catalog import Catalog
from mmidx.toolkit.view.guard import LOOPBACK, client_of

PROBES = 10
PROBE_SECONDS = 5.0  # each probe's bound: the flood keeps the machine busy, but must not shut the user out


@pytest.fixture(scope="module")
def catalog(tmp_path_factory):
    return Catalog([str(build_planted_dataset(tmp_path_factory.mktemp("floods")))])


needs_aliases = pytest.mark.skipif(not loopback_aliases(), reason="127.0.0.2 cannot be bound: this machine's "
                                                                  "loopback has one address")


def test_every_loopback_address_is_one_client_and_other_addresses_are_their_own():
    for address in ("127.0.0.1", "127.0.0.2", "127.255.255.254", "::1", "::ffff:127.0.0.3"):
        assert client_of(address) == LOOPBACK, address
    for address in ("10.1.2.3", "192.168.0.7", "::ffff:10.1.2.3", "2001:db8::1", "fe80::1%eth0", ""):
        assert client_of(address) == address, address


@pytest.fixture
def held(monkeypatch):
    """The overview held until the test releases it: ``held.started`` counts the requests that reached it."""
    release, lock, original = threading.Event(), threading.Lock(), Viewer.overview

    class Held:
        started = 0

        @staticmethod
        def release():
            release.set()

    def overview(self, request):
        with lock:
            Held.started += 1
        release.wait(30)
        return original(self, request)

    monkeypatch.setattr(Viewer, "overview", overview)
    yield Held
    release.set()


def address(url: str) -> tuple[str, int]:
    host, port = url.split("//")[1].strip("/").rsplit(":", 1)
    return host, int(port)


def request(host: str, path: str, close: bool = False) -> bytes:
    """A GET of ``path``, asking the server to close the connection after its response (``close``) or not."""
    return f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: {'close' if close else 'keep-alive'}\r\n\r\n".encode()


def connection(url: str, data: bytes, responses: int = 0) -> tuple[socket.socket, bytes]:
    """A connection to ``url`` that sent ``data`` and read until ``responses`` responses began, and what it read."""
    sock = socket.create_connection(address(url), timeout=10)
    sock.sendall(data)
    received = b""
    while received.count(b"HTTP/1.1 ") < responses:
        chunk = sock.recv(1 << 16)
        assert chunk, f"closed after {received.count(b'HTTP/1.1 ')} of {responses} responses: {received[-300:]!r}"
        received += chunk
    return sock, received


def busy(url: str, held, answered: int) -> tuple[socket.socket, bytes]:
    """A connection answered ``answered`` style sheets, then with a request for the held overview in progress."""
    host, expected = address(url)[0], held.started + 1
    sock, received = connection(url, request(host, "/style.css") * answered + request(host, f"/?{expected}", True),
                                answered)
    deadline = time.monotonic() + 10
    while held.started < expected and time.monotonic() < deadline:
        time.sleep(0.01)
    assert held.started == expected
    return sock, received


def statuses(sock: socket.socket, received: bytes) -> list[bytes]:
    """The statuses of every response on ``sock`` (with ``received`` read before), read until the server closes."""
    sock.settimeout(10)
    while chunk := sock.recv(1 << 16):
        received += chunk
    return re.findall(rb"HTTP/1.1 (\d{3}) ", received)


def answered_200(url: str, path: str = "style.css") -> bool:
    """Whether a request on a new connection is answered 200."""
    return httpx.get(url + path, headers={"Connection": "close"}, timeout=10).status_code == 200


def test_a_new_connection_gets_in_when_every_other_is_busy_and_the_busiest_makes_room(catalog, held):
    with serving(catalog, per_client=4) as url:
        (busiest, _), *others = (busy(url, held, answered) for answered in (3, 1, 0, 0))
        try:
            assert answered_200(url)  # was closed at once: every other connection of its client was busy
            assert closed_within([busiest], 2.0) == 1  # dropped: it had been answered the most
            assert closed_within([sock for sock, _ in others], 0.3) == 0
            held.release()
            assert [statuses(*other) for other in others] == [[b"200"] * 2, [b"200"], [b"200"]]
        finally:
            held.release()
            for sock in [busiest, *(sock for sock, _ in others)]:
                sock.close()


def test_an_idle_keep_alive_makes_room_before_a_stalled_or_a_busy_connection(catalog, held):
    with serving(catalog, per_client=4, keep_alive=30) as url:
        first_stalled = stall(url, 1)
        working, _ = busy(url, held, 0)
        idle, _ = connection(url, request(address(url)[0], "/style.css"), 1)
        stalled = first_stalled + stall(url, 1)
        try:
            assert answered_200(url)
            assert closed_within([idle], 2.0) == 1  # answered and waiting: closing it costs no request
            assert closed_within([*stalled, working], 0.3) == 0
        finally:
            held.release()
            for sock in (*stalled, working, idle):
                sock.close()


def test_a_connection_that_sent_no_request_yet_keeps_its_place_while_such_are_at_most_half(catalog, held):
    """A browser's new connection waits for its request to be read like a stalled one; a pipelined flood that
    opens connections again as they are dropped must not close it in that moment: while connections that sent
    no request are at most half of the client's, the busiest makes room."""
    with serving(catalog, per_client=4) as url:
        waiting = stall(url, 1)
        (busiest, _), *others = (busy(url, held, answered) for answered in (2, 0, 0))
        try:
            assert answered_200(url)
            assert closed_within([busiest], 2.0) == 1
            assert closed_within([*waiting, *(sock for sock, _ in others)], 0.3) == 0
        finally:
            held.release()
            for sock in [*waiting, busiest, *(sock for sock, _ in others)]:
                sock.close()


@needs_aliases
def test_stalled_connections_from_other_loopback_addresses_count_against_the_same_client(catalog):
    with serving(catalog, per_client=4) as url:
        stalled = [sock for source in OTHER_LOOPBACK for sock in stall(url, 1, source)]
        try:
            assert answered_200(url)
            assert closed_within(stalled[:1], 2.0) == 1  # 127.0.0.2's, the oldest, made room for 127.0.0.1's
            assert closed_within(stalled[1:], 0.3) == 0
        finally:
            for sock in stalled:
                sock.close()


def probes(url: str) -> list[tuple[int | str, float]]:
    """``PROBES`` requests from 127.0.0.1, each on a new connection, for the overview and for sample pages:
    their statuses (or errors) and seconds."""
    results = []
    for number in range(PROBES):
        path = f"dataset/planted/sample/{number}" if number % 2 else ""
        start = time.monotonic()
        try:
            status: int | str = httpx.get(url + path, timeout=PROBE_SECONDS).status_code
        except httpx.HTTPError as error:
            status = type(error).__name__
        results.append((status, round(time.monotonic() - start, 2)))
    return results


def answered_in_time(results: list[tuple[int | str, float]]) -> int:
    return sum(status == 200 and seconds <= PROBE_SECONDS for status, seconds in results)


@needs_aliases
def test_n1_1024_stalled_connections_from_127_0_0_2_to_5_leave_the_users_requests_answered(catalog):
    """N1: they made every request from anyone a 503 while they lasted (uvicorn's limit of 1,024 connections)."""
    with serving(catalog) as url:
        assert answered_200(url, "") and answered_200(url, "dataset/planted/sample/1")  # computed once before
        with flooding(url, "stall", 256, *OTHER_LOOPBACK) as counts:
            results = probes(url)
    assert answered_in_time(results) >= PROBES - 1, results
    assert counts["opened"] >= 4 * 256


def test_n2_256_connections_of_pipelined_requests_from_127_0_0_1_leave_the_users_requests_answered(catalog):
    """N2: they made the viewer reset every new connection from 127.0.0.1 (all 10 of the user's probes)."""
    with serving(catalog) as url:
        assert answered_200(url, "") and answered_200(url, "dataset/planted/sample/1")
        with flooding(url, "pipeline", 256, 8, "/") as counts:
            results = probes(url)
    assert answered_in_time(results) >= PROBES - 1, results
    assert counts["opened"] >= 256 and counts["answered"] >= 256  # the flood was served as well, not shut out
