"""The viewer's HTML building blocks: escaping, the page frame, its stylesheet, URLs and bar charts.

Every value that comes from data (captions, file names, report details, dataset names) goes through
:func:`esc` before it is placed in a page; the pages are plain HTML and inline SVG with no script,
so they work without a JavaScript build step (or JavaScript at all).
"""

from __future__ import annotations

import html
from urllib.parse import quote, urlencode

from mmidx.toolkit.view.stats import Histogram

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 0; color: #1d1d1f; background: #fafafa; }
header { background: #1d2733; color: #fff; padding: 8px 16px; display: flex; gap: 18px; align-items: baseline; }
header a { color: #cfe3ff; text-decoration: none; } header strong { font-size: 16px; }
main { padding: 12px 16px 40px; max-width: 1280px; }
h1 { font-size: 20px; margin: 8px 0 12px; } h2 { font-size: 17px; margin: 22px 0 8px; }
h3 { font-size: 15px; margin: 14px 0 6px; }
table { border-collapse: collapse; margin: 6px 0 12px; background: #fff; }
td, th { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f0f2f5; font-weight: 600; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
.note { color: #555; } .bad { color: #b00020; } .ok { color: #137333; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px 14px; margin: 12px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { background: #fff; border: 1px solid #e3e3e3; padding: 6px 8px; width: 340px; }
.chart svg { width: 100%; height: auto; } .chart .title { font-weight: 600; font-size: 13px; }
.chart rect.bar { fill: #4285f4; } .chart rect.bar:hover { fill: #1a5ed8; }
.chart text { font-size: 10px; fill: #444; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(200px, 1fr)); gap: 10px; }
.cell { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 6px; overflow: hidden; }
.cell img { display: block; max-width: 100%; height: 150px; object-fit: contain; margin: 0 auto 4px; background: #eee; }
.cell .textonly { height: 150px; display: flex; align-items: center; justify-content: center; background: #eee; }
.cell a { text-decoration: none; color: inherit; } .cell .caption { font-size: 12px; }
.pager { margin: 10px 0; display: flex; gap: 12px; }
.element { border-left: 4px solid #ccc; padding: 4px 10px; margin: 6px 0; background: #fff; }
.element.loss { border-left-color: #202020; } .element .kind { font-weight: 600; }
.element img { height: 96px; width: auto; vertical-align: middle; border: 1px solid #ddd; margin-top: 4px; }
.text { white-space: pre-wrap; font-family: ui-monospace, monospace; font-size: 13px; }
.text.loss { background: #fff3d6; } .text.cfg { outline: 2px dashed #34a853; outline-offset: 2px; }
.legend span { display: inline-block; margin-right: 14px; }
.legend .swatch { display: inline-block; width: 12px; height: 12px; margin-right: 4px; vertical-align: -1px;
  border: 1px solid #999; }
img.full { max-width: 100%; height: auto; border: 1px solid #ddd; background: #eee; }
svg.attention { width: 100%; max-width: 900px; height: auto; background: #fff; border: 1px solid #ddd; }
svg.attention text { font: 10px ui-monospace, monospace; fill: #222; }
svg.attention line { stroke: #5a5a5a; stroke-width: 0.6; }
svg.attention rect.band, svg.attention rect.split { fill: transparent; }
svg.attention rect.band:hover { fill: rgba(0, 0, 0, 0.10); }
svg.attention rect.split:hover { fill: rgba(0, 0, 0, 0.25); }
form.search input[type=text] { width: 320px; padding: 3px 6px; }
""".strip()


_INVISIBLE = [*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0),  # controls, not \t \n \r
              0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F), *range(0x2066, 0x206A),  # bidi marks and overrides
              0xFEFF, 0xFFF9, 0xFFFA, 0xFFFB]  # byte order mark, interlinear annotation controls
VISIBLE = {code: (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}") for code in _INVISIBLE}
"""``str.translate`` table: each control or bidi character as the escape Python writes for it (NUL → ``\\x00``,
RIGHT-TO-LEFT OVERRIDE → ``\\u202e``), so data can neither hide text nor reorder what the page shows."""


def esc(value: object) -> str:
    """``value`` as text safe inside HTML elements and quoted attributes, control and bidi characters shown as
    escapes (:data:`VISIBLE`)."""
    return html.escape(str(value).translate(VISIBLE), quote=True)


def dataset_url(name: str, what: str = "samples", **query: object) -> str:
    """URL of a dataset's page ``what`` ("samples", "search", "sample/12"), with ``query`` parameters."""
    url = f"/dataset/{quote(name, safe='')}/{what}"
    return f"{url}?{urlencode(query)}" if query else url


def sample_url(name: str, sample: int) -> str:
    return dataset_url(name, f"sample/{int(sample)}")


def page(title: str, body: str, *, packs: bool = True) -> str:
    """A complete page: ``body`` (already HTML) under the viewer's header."""
    packs_link = '<a href="/packs">Packs</a>' if packs else ""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{esc(title)} · mmidx view</title><link rel=\"stylesheet\" href=\"/style.css\">"
            "<link rel=\"icon\" href=\"data:,\"></head><body>"
            f"<header><strong>mmidx view</strong><a href=\"/\">Overview</a>{packs_link}</header>"
            f"<main><h1>{esc(title)}</h1>{body}</main></body></html>")


def table(headers: list[str], rows: list[list[str]], numeric: set[int] = frozenset()) -> str:
    """A table of already-escaped cells; columns in ``numeric`` are right-aligned."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="n">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(row)) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def bar_chart(histogram: Histogram) -> str:
    """An inline SVG bar chart of ``histogram``; hovering a bar names its range and count."""
    if not histogram.counts:
        return f'<div class="chart"><div class="title">{esc(histogram.title)}</div><p class="note">no values</p></div>'
    width, height, bottom = 360, 130, 16
    peak = max(histogram.counts) or 1
    step = width / len(histogram.counts)
    bars = []
    for number, (label, count) in enumerate(zip(histogram.labels, histogram.counts, strict=True)):
        tall = (height - bottom - 12) * count / peak
        share = count / histogram.total if histogram.total else 0.0
        bars.append(f'<rect class="bar" x="{number * step + 0.5:.1f}" y="{height - bottom - tall:.1f}" '
                    f'width="{max(step - 1, 0.5):.1f}" height="{max(tall, 0.0):.1f}">'
                    f"<title>{esc(label)}: {count:,} ({share:.1%})</title></rect>")
    if len(histogram.labels) <= 8:  # few bars (kinds, small counts): name each under it
        axis = "".join(f'<text x="{(number + 0.5) * step:.1f}" y="{height - 3}" text-anchor="middle">'
                       f"{esc(label)}</text>" for number, label in enumerate(histogram.labels))
    else:
        axis = (f'<text x="0" y="{height - 3}">{esc(histogram.labels[0])}</text>'
                f'<text x="{width}" y="{height - 3}" text-anchor="end">{esc(histogram.labels[-1])}</text>')
    axis += f'<text x="0" y="9">max {peak:,}</text>'
    return (f'<div class="chart"><div class="title">{esc(histogram.title)} '
            f'<span class="note">({histogram.total:,} values)</span></div>'
            f'<svg viewBox="0 0 {width} {height}" role="img" aria-label="{esc(histogram.title)}">'
            f'{"".join(bars)}{axis}</svg></div>')

