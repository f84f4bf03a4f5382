"""Screenshots of ``mmidx view`` for the README: the overview, a sample and a pack of the demo's datasets.

Runs the quick demo in ``--workdir`` (unless its ``datasets/data.yaml`` is already there), serves it
with the viewer on 127.0.0.1, opens each page in headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through the test suite's ``tests/support/browser.py``), and saves the top of
each page as a palette PNG, smaller than ``--max-bytes``, under ``--out``.

Run: ``python tools/screenshots.py [--out docs/images] [--workdir /tmp/mmidx-screenshots]``.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # one headless-Chromium setup, the tests' own

from support.browser import chromium_missing, headless_chromium  # noqa: E402

from mmidx.toolkit.view.app import serving  # noqa: E402
from mmidx.toolkit.view.catalog import Catalog  # noqa: E402

PAGES = {  # file name -> (path, what it shows)
    "view-overview.png": ("/", "the overview: counts, build report and histograms of each dataset"),
    "view-sample.png": ("/dataset/seedxedit_multi/sample/0", "an edit sample: its views, elements and images"),
    "view-pack.png": ("/pack/0", "pack 0: its attention layout and its samples"),
}


def small_png(png: bytes, max_bytes: int) -> bytes:
    """``png`` as a 256-colour PNG, halved in width until it is under ``max_bytes``."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    while True:
        out = io.BytesIO()
        image.quantize(256, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
        if out.tell() <= max_bytes or image.width < 400:
            return out.getvalue()
        image = image.resize((image.width * 3 // 4, image.height * 3 // 4), Image.Resampling.LANCZOS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"), help="folder for the PNGs")
    parser.add_argument("--workdir", default="/tmp/mmidx-screenshots", help="folder of the demo's data")
    parser.add_argument("--width", type=int, default=1200, help="browser window width in pixels")
    parser.add_argument("--height", type=int, default=1400, help="most pixels of each page kept, from its top")
    parser.add_argument("--max-bytes", type=int, default=300_000, help="largest PNG written")
    args = parser.parse_args()
    missing = chromium_missing()
    if missing:
        print(f"screenshots: {missing}", file=sys.stderr)
        return 1
    data_yaml = Path(args.workdir) / "datasets" / "data.yaml"
    if not data_yaml.exists():
        from mmidx.toolkit.demo import run

        run(args.workdir, quick=True, progress=print)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    catalog = Catalog([str(data_yaml)])
    catalog.warm()  # overviews, structure verdicts, tokenizers and packs computed before the first page
    with serving(catalog) as url:
        driver = headless_chromium(args.width, args.height)
        try:
            for name, (path, what) in PAGES.items():
                driver.get(url + path.lstrip("/"))
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.set_window_size(args.width, min(height, args.height))
                png = small_png(driver.get_screenshot_as_png(), args.max_bytes)
                (out / name).write_bytes(png)
                print(f"{out / name}: {what} ({len(png):,} bytes)")
        finally:
            driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
