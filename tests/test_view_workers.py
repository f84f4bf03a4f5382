"""The viewer's page work (mmidx.toolkit.view.workers): a late page's response is kept for its reload, within both
bounds, the count (``MAX_KEPT``) and the bytes (``MAX_KEPT_BYTES``), each evicting the oldest on its own."""

import asyncio
import threading

import pytest
from starlette.requests import Request
from starlette.responses import Response

from mmidx.format import FormatError
from mmidx.toolkit.view import workers as view_workers
from mmidx.toolkit.view.workers import Refused, Workers

BODY = 1000  # bytes of each page's response


def request(path: str) -> Request:
    return Request({"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": [],
                    "scheme": "http", "server": ("testserver", 80)})


class Pages:
    """Page work that counts its calls per path; a page asked ``late`` waits until its requester was answered 503."""

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.threads: set[str] = set()
        self.release = threading.Event()

    def work(self, late: bool):
        def page(req: Request) -> Response:
            self.calls[req.url.path] = self.calls.get(req.url.path, 0) + 1
            self.threads.add(threading.current_thread().name)
            if late:
                assert self.release.wait(30), "the test never released the page"
            return Response(b"x" * BODY)
        return page


async def ask_late(workers: Workers, pages: Pages, path: str) -> None:
    """Ask for ``path`` and be answered 503; the work then finishes and its response is kept."""
    pages.release.clear()
    response = await workers.answer(pages.work(late=True), request(path))
    assert response.status_code == 503 and "what was computed is kept: reload it in a moment" in response.body.decode()
    pages.release.set()
    await asyncio.wrap_future(workers.pool.submit(int))  # one thread: its work and done callback ran before this


async def reloads(workers: Workers, pages: Pages, paths: list[str]) -> list[bool]:
    """Each path asked again: whether its response came from what was kept (the work was not run again)."""
    served = []
    for path in paths:
        before = pages.calls[path]
        response = await workers.answer(pages.work(late=False), request(path))
        assert response.status_code == 200 and len(response.body) == BODY
        served.append(pages.calls[path] == before)
    return served


def kept_after_three_late_pages() -> list[bool]:
    async def scenario():
        workers, pages = Workers(workers=1, time_limit=0.3), Pages()
        try:
            for path in ("/a", "/b", "/c"):
                await ask_late(workers, pages, path)
            return await reloads(workers, pages, ["/c", "/b", "/a"])
        finally:
            workers.pool.shutdown(wait=True)
    return asyncio.run(scenario())


def test_late_pages_are_kept_for_their_reload_within_both_bounds():
    assert kept_after_three_late_pages() == [True, True, True]


def test_the_count_bound_alone_evicts_the_oldest_kept_response(monkeypatch):
    monkeypatch.setattr(view_workers, "MAX_KEPT", 2)
    assert 3 * BODY < view_workers.MAX_KEPT_BYTES  # the bytes bound keeps all three
    assert kept_after_three_late_pages() == [True, True, False]


def test_the_bytes_bound_alone_evicts_the_oldest_kept_response(monkeypatch):
    monkeypatch.setattr(view_workers, "MAX_KEPT_BYTES", 2 * BODY + BODY // 2)
    assert view_workers.MAX_KEPT >= 3  # the count bound keeps all three
    assert kept_after_three_late_pages() == [True, True, False]


def test_responses_of_exactly_the_bounds_are_all_kept(monkeypatch):
    monkeypatch.setattr(view_workers, "MAX_KEPT", 3)
    monkeypatch.setattr(view_workers, "MAX_KEPT_BYTES", 3 * BODY)
    assert kept_after_three_late_pages() == [True, True, True]


def test_work_runs_in_the_pool_of_named_threads_and_what_had_not_started_is_dropped_when_its_requester_gives_up(
        caplog):
    pages = Pages()

    async def scenario():
        workers = Workers(workers=2, time_limit=0.5)
        try:  # four late pages at once: the pool's two run (and are kept), the two queued behind them are dropped
            responses = await asyncio.gather(*(workers.answer(pages.work(late=True), request(f"/{n}"))
                                               for n in range(4)))
            pages.release.set()
            return [response.status_code for response in responses]
        finally:
            workers.pool.shutdown(wait=True)

    with caplog.at_level("ERROR"):
        assert asyncio.run(scenario()) == [503] * 4
    assert pages.calls == {"/0": 1, "/1": 1}
    assert pages.threads and all(name.startswith("mmidx-view") for name in pages.threads)
    assert not caplog.records  # dropping a page raised nothing in its done callback


def test_a_second_request_while_a_page_is_computed_joins_its_work():
    pages = Pages()

    async def scenario():
        workers = Workers(workers=2, time_limit=30)
        try:
            asked = [asyncio.ensure_future(workers.answer(pages.work(late=True), request("/3"))) for _ in range(2)]
            await asyncio.sleep(0.2)  # both are waiting for the one computation
            pages.release.set()
            return [response.status_code for response in await asyncio.gather(*asked)]
        finally:
            workers.pool.shutdown(wait=True)

    assert asyncio.run(scenario()) == [200, 200]
    assert pages.calls == {"/3": 1}


@pytest.mark.parametrize("name, value", [("MAX_KEPT", 64), ("MAX_KEPT_BYTES", 64 * 2**20)])
def test_the_kept_bounds_are_the_documented_ones(name, value):
    assert getattr(view_workers, name) == value  # docs/guide/viewer-security.md names both


@pytest.mark.parametrize("kind, status, line", [
    (Refused, 404, "no sample 7 in t2i (it has 3)"),
    (FormatError, 500, "cannot be read: t2i.idx: truncated at byte 12"),
])
def test_a_refusal_or_damaged_data_is_an_error_page_with_its_status_and_line(kind, status, line):
    error = Refused(404, line) if kind is Refused else kind(line.removeprefix("cannot be read: "))

    def page(req: Request) -> Response:
        raise error

    async def scenario():
        workers = Workers(workers=1, time_limit=30)
        try:
            return await workers.answer(page, request("/sample/7"))
        finally:
            workers.pool.shutdown(wait=True)

    response = asyncio.run(scenario())
    assert response.status_code == status and line in response.body.decode()
    assert f"<title>{status}: " in response.body.decode()  # the page names its status
    assert str(error) == line.removeprefix("cannot be read: ")
