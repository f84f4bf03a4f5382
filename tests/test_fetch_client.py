"""The fetcher alone: per-host caps over host names pinned to 127.0.0.1, deadlines that end every stuck
fetch on time, DNS failures, and opt-out headers decided before the body."""

import socket
import sys
import time

import pytest
from support.http_faults import FaultServer
from support.sources import image_bytes

from mmidx.fetch import client
from mmidx.fetch.client import FetchPool, FetchSettings
from mmidx.fetch.outcomes import is_transient


@pytest.fixture(scope="module")
def server():
    server = FaultServer(latency=(0.05, 0.05))
    server.add_image("a", image_bytes(16, 16, "RGB", "PNG"))
    yield server
    server.stop()


def test_the_per_host_cap_holds_for_each_host_while_hosts_run_side_by_side(server):
    hosts = ("a.example", "b.example", "c.example")
    settings = FetchSettings(concurrency=64, per_host=2, hosts=dict.fromkeys(hosts, "127.0.0.1"))
    with FetchPool(settings) as pool:
        futures = [pool.submit(server.url(f"/image/a?cap={i}", host)) for host in hosts for i in range(8)]
        results = [future.result() for future in futures]
    assert {result.outcome for result in results} == {"ok"}
    assert {host: server.max_in_flight[host] for host in hosts} == dict.fromkeys(hosts, 2)
    assert server.max_in_flight_total > 2  # the cap is per host, not global


def test_the_global_concurrency_bounds_all_hosts_together(server):
    hosts = ("d.example", "e.example")
    settings = FetchSettings(concurrency=3, per_host=3, hosts=dict.fromkeys(hosts, "127.0.0.1"))
    server.max_in_flight_total = 0
    with FetchPool(settings) as pool:
        assert all(future.result().outcome == "ok" for future in
                   [pool.submit(server.url(f"/image/a?global={i}", host)) for host in hosts for i in range(6)])
    assert server.max_in_flight_total == 3


@pytest.mark.parametrize("uvloop", ["installed", "absent"])
def test_the_pool_runs_on_uvloop_when_installed_and_on_asyncio_otherwise_with_the_same_outcomes(server, uvloop,
                                                                                                 monkeypatch):
    if uvloop == "absent":
        monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    paths = ["/image/a", "/status/404", "/reset", "/redirect/2/a", "/html", "/loop", "/short/a"]
    with FetchPool(FetchSettings(timeout=1.0, retries=0)) as pool:
        loop = type(pool._loop).__module__.split(".")[0]
        results = [pool.submit(server.url(f"{path}?{uvloop}")).result() for path in paths]
    assert loop == ("uvloop" if uvloop == "installed" else "asyncio")
    assert [result.outcome for result in results] == ["ok", "not_found", "connection", "ok", "not_an_image",
                                                      "redirects", "connection"]
    assert results[0].body == results[3].body == server.images["a"]


@pytest.mark.parametrize("path", ["/drip", "/reset", "/short/a", "/loop", "/redirect/9/a"])
def test_a_stuck_or_broken_fetch_ends_within_the_deadline(server, path):
    with FetchPool(FetchSettings(timeout=1.0, retries=0)) as pool:
        started = time.monotonic()
        result = pool.submit(server.url(f"{path}?deadline")).result()
        elapsed = time.monotonic() - started
    assert result.outcome != "ok" and elapsed < 1.5


def test_retries_add_at_most_their_backoff_to_the_deadline(server):
    settings = FetchSettings(timeout=0.5, retries=2, backoff=0.1)
    with FetchPool(settings) as pool:
        started = time.monotonic()
        result = pool.submit(server.url("/drip?retries")).result()
        elapsed = time.monotonic() - started
    assert result.outcome == "timeout" and result.attempts == 3
    assert elapsed < 3 * 0.5 + (0.1 + 0.1) + (0.2 + 0.1) + 0.5


def test_a_name_that_does_not_resolve_is_a_dns_failure(server, monkeypatch):
    async def no_such_host(self, host, port=0, family=socket.AF_INET):
        raise OSError(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(client.DefaultResolver, "resolve", no_such_host)  # no query leaves this machine
    with FetchPool(FetchSettings(retries=1, backoff=0.01)) as pool:
        result = pool.submit("http://no-such-host.example/x.jpg").result()
    assert (result.outcome, result.attempts) == ("dns", 2) and is_transient("dns", None)


@pytest.mark.parametrize(("values", "opted_out"), [
    (["noai"], True), (["noimageai"], True), (["noindex, NoAI"], True), (["mmidx: noai"], True),
    (["mytoken: noimageai"], True), (["otherbot: noai"], False), (["noindex", "nofollow"], False),
    (["otherbot: noindex, noai"], False), (["otherbot: noindex", "noai"], True), ([], False),
    (["max-snippet: 20, noai"], True), (["unavailable_after: 2026-01-01, noimageai"], True),
])
def test_opt_out_is_read_from_x_robots_tag_for_every_agent_or_this_one(values, opted_out):
    assert client._opted_out(values, ("mmidx", "mytoken")) is opted_out


@pytest.mark.parametrize(("header", "seconds"), [("3", 3.0), ("0", 0.0), ("soon", None), (None, None),
                                                 ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0)])
def test_retry_after_is_read_as_seconds_or_as_a_date(header, seconds):
    assert client._retry_after(header) == seconds


def test_image_signatures_are_recognised_and_html_is_not():
    for fmt in ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF"):
        assert client.is_image_signature(image_bytes(8, 8, "RGB", fmt)[:12]), fmt
    assert not client.is_image_signature(b"<!doctype html>")
    assert not client.is_image_signature(b"RIFF\x00\x00\x00\x00WAVE")
