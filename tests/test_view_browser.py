"""mmidx view in a real browser: headless Chromium (Debian's packages) renders the demo's datasets and the
planted one with no console error and every image loaded; the overview's links reach a sample and a
pack; the search box finds the planted caption and shows its markup as text; pages of thumbnails load whole
while other local processes flood the viewer (issue 44)."""

import time
from pathlib import Path
from urllib.parse import urlparse

import pytest
from support.browser import chromium_missing, headless_chromium
from support.floods import OTHER_LOOPBACK, flooding, loopback_aliases
from support.view_data import (
    PLANTED_CAPTION,
    PLANTED_SAMPLE,
    PLANTED_WORD,
    TEXT_ONLY_SAMPLE,
    TIFF_SAMPLE,
    TWO_VIEWS_SAMPLE,
    build_planted_dataset,
)

from mmidx.toolkit.view.app import serving
from mmidx.toolkit.view.catalog import Catalog

pytestmark = pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))


@pytest.fixture(scope="module")
def site(demo, tmp_path_factory):
    planted = build_planted_dataset(tmp_path_factory.mktemp("view-browser"))
    catalog = Catalog([str(Path(demo["workdir"]) / "datasets" / "data.yaml"), str(planted)])
    with serving(catalog) as url:
        driver = headless_chromium()
        try:
            yield {"url": url, "driver": driver, "catalog": catalog}
        finally:
            driver.quit()


def visit(site, path: str) -> dict:
    """Load ``path`` and return its title, console errors and each image's (src, loaded)."""
    driver = site["driver"]
    driver.get(site["url"] + path.lstrip("/"))
    images = driver.execute_script(
        "return Array.from(document.images).map(i => [i.getAttribute('src'), i.complete && i.naturalWidth > 0])")
    errors = [entry["message"] for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]
    return {"title": driver.find_element("tag name", "h1").text, "errors": errors, "images": images}


def test_every_page_renders_without_console_errors_and_with_every_image_loaded(site):
    names = list(site["catalog"].datasets)
    packs = len(site["catalog"].pack_index().index)
    pages = ["/", "/packs", "/pack/0", f"/pack/{packs - 1}"]
    pages += [f"/dataset/{name}/samples" for name in names] + [f"/dataset/{name}/sample/1" for name in names]
    pages += [f"/dataset/planted/sample/{i}" for i in (TWO_VIEWS_SAMPLE, TEXT_ONLY_SAMPLE, TIFF_SAMPLE)]
    pages += ["/dataset/planted/samples?page=1", f"/dataset/planted/search?q={PLANTED_WORD}"]
    with_images = 0
    for page in pages:
        seen = visit(site, page)
        assert seen["errors"] == [], (page, seen["errors"])
        assert seen["title"] and "404" not in seen["title"], page
        assert all(loaded for _, loaded in seen["images"]), (page, [src for src, ok in seen["images"] if not ok])
        with_images += bool(seen["images"])
    assert with_images >= 2 * len(names)  # every grid and every sample page but the text-only one has images


def test_links_from_the_overview_reach_a_sample_and_a_pack(site):
    driver = site["driver"]
    first = next(iter(site["catalog"].datasets))
    visit(site, "/")
    driver.find_element("link text", "sample 0").click()
    assert urlparse(driver.current_url).path == f"/dataset/{first}/sample/0"
    assert driver.find_element("tag name", "h1").text.startswith(f"{first}: sample 0 of")
    visit(site, "/")
    driver.find_element("link text", "pack 0").click()
    assert urlparse(driver.current_url).path == "/pack/0"
    svg = driver.find_element("css selector", "svg.attention")
    assert svg.size["width"] > 300 and svg.size["height"] > 300  # drawn, scaled to the page
    titles = driver.execute_script("return Array.from(document.querySelectorAll('svg.attention rect.split title'))"
                                   ".map(t => t.textContent)")
    assert titles and all(" split " in title and " tokens" in title for title in titles)
    link = driver.find_element("css selector", "table a[href*='/sample/']")
    target = urlparse(link.get_attribute("href")).path
    link.click()
    assert urlparse(driver.current_url).path == target and " sample " in driver.find_element("tag name", "h1").text


def test_the_search_box_finds_the_planted_caption_and_shows_its_markup_as_text(site):
    driver = site["driver"]
    visit(site, "/dataset/planted/samples")
    box = driver.find_element("css selector", "form.search input[name=q]")
    box.send_keys(PLANTED_WORD)
    box.submit()
    hits = driver.find_elements("css selector", "table a[href*='/sample/']")
    assert [urlparse(a.get_attribute("href")).path for a in hits] == [f"/dataset/planted/sample/{PLANTED_SAMPLE}"]
    assert PLANTED_CAPTION in driver.find_element("tag name", "table").text  # shown as text, not run as markup
    assert driver.execute_script("return document.querySelectorAll('main script, main b').length") == 0
    hits[0].click()
    assert PLANTED_CAPTION in driver.find_element("tag name", "main").text


@pytest.mark.parametrize("kind, args", [("pipeline", (256, 8, "/")), ("stall", (256, *OTHER_LOOPBACK))],
                         ids=["256-pipelined-from-127.0.0.1", "1024-stalled-from-127.0.0.2-5"])
def test_pages_of_thumbnails_load_whole_in_the_browser_while_another_process_floods_the_viewer(tmp_path_factory,
                                                                                              kind, args):
    """The user's requests as a browser makes them: a page, then its thumbnails over the few connections it keeps
    alive and opens again as the viewer closes them to make room for the flood's."""
    if kind == "stall" and not loopback_aliases():
        pytest.skip("127.0.0.2 cannot be bound: this machine's loopback has one address")
    catalog = Catalog([str(build_planted_dataset(tmp_path_factory.mktemp("flooded")))])
    with serving(catalog) as url:
        driver = headless_chromium()
        try:
            driver.set_page_load_timeout(60)
            with flooding(url, kind, *args):
                for page in ("/dataset/planted/samples", "/dataset/planted/samples?page=1",
                             f"/dataset/planted/sample/{TWO_VIEWS_SAMPLE}"):
                    start = time.monotonic()
                    seen = visit({"url": url, "driver": driver}, page)
                    seconds = time.monotonic() - start
                    assert seen["errors"] == [] and seen["images"], (page, seen["errors"])
                    assert all(loaded for _, loaded in seen["images"]), (page, seen["images"])
                    # 48 thumbnails made beside the flood on 2 cores: under 30 s in earlier CI runs, 30.1 s
                    # once at a load average of 5-8 (mutation testing beside the suite); under the page timeout
                    assert seconds < 50, (page, seconds)
        finally:
            driver.quit()
