"""The viewer's pages, rendered from plain data to HTML (every data value escaped by :func:`esc`).

Each function takes what a route computed and returns one complete page; each page is bounded:
grids and lists are paginated, texts and element lists are cut at fixed lengths, with a note.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from mmidx.toolkit.sample import element_flags
from mmidx.toolkit.show import COLOURS, LOSS_COLOUR
from mmidx.toolkit.view.markup import bar_chart, dataset_url, esc, page, sample_url, table
from mmidx.toolkit.view.packs import PackLayout
from mmidx.toolkit.view.search import SearchResult
from mmidx.toolkit.view.stats import Histogram

MAX_TEXT_CHARS = 20_000
MAX_TEXT_TOKENS = 10_000  # decoded per text on a sample page: about 4 characters a token fill MAX_TEXT_CHARS
MAX_ELEMENTS = 400
MAX_VIEWS = 16
MAX_EXTRA_CHARS = 4_000


def _report(report: dict[str, Any] | None) -> str:
    if report is None:
        return '<p class="note">No build report beside the dataset (PREFIX.report.json).</p>'
    verdict = "ok" if report.get("ok") else "bad"
    parts = [f'<p>Build report: <span class="{verdict}">{"OK" if report.get("ok") else "FAILED"}</span>: '
             f'{esc(report.get("message", ""))}. {int(report.get("rows", 0)):,} rows → '
             f'{int(report.get("samples", 0)):,} samples, {int(report.get("skipped", 0)):,} skipped, '
             f'{int(report.get("warned", 0)):,} warned.</p>']
    skips = report["skips"]
    for title, entries in (("Fetch outcomes", {k: v for k, v in skips.items() if k.startswith("fetch:")}),
                           ("Skips by reason", {k: v for k, v in skips.items() if not k.startswith("fetch:")}),
                           ("Warnings by reason", report["warnings"])):
        if not entries:
            continue
        rows = []
        for reason, entry in sorted(entries.items(), key=lambda item: -int(item[1].get("count", 0))):
            examples = entry.get("examples") or [{}]
            first = examples[0] if isinstance(examples[0], dict) else {}
            where = f"line {first['line']}" if "line" in first else f"row {first.get('row', '?')}"
            example = f"{first.get('file', '')} {where}: {first.get('detail', '')}" if first else ""
            rows.append([esc(reason), f"{int(entry.get('count', 0)):,}", esc(entry["description"]), esc(example)])
        parts.append(f"<h3>{title}</h3>" + table(["reason", "count", "what it means", "first example"], rows, {1}))
    return "".join(parts)


def _structure(verdict: str | None) -> str:
    if verdict is None:
        return ('<p class="note">Structure: being checked (every O(n) invariant of the index arrays); reload to '
                "see the verdict.</p>")
    if verdict == "sound":
        return '<p>Structure: <span class="ok">sound</span> (every O(n) invariant of the index arrays holds).</p>'
    return (f'<p>Structure: <span class="bad">BROKEN</span>: {esc(verdict)}. The histograms below may be wrong; '
            "run <code>mmidx verify</code>.</p>")


def overview_page(entries: list[tuple[Any, dict[str, Any], str | None]], packs_note: str, packs: bool) -> str:
    """``entries``: (catalog entry, :func:`mmidx.toolkit.view.stats.overview`, structure verdict) of every dataset."""
    rows = [[f'<a href="{esc(dataset_url(entry.name))}">{esc(entry.name)}</a>', esc(entry.group or "-"),
             esc(info["kind"]), f"{info['samples']:,}", f"{info['tokens']:,}", f"{info.get('images', 0):,}",
             f"{info['bytes']:,}"] for entry, info, _ in entries]
    body = [table(["dataset", "group", "kind", "samples", "tokens", "images", "bytes"], rows, {3, 4, 5, 6}),
            f'<p class="note">{esc(packs_note)}' + (' — <a href="/packs">packs</a>, <a href="/pack/0">pack 0</a>'
                                                    if packs else "") + "</p>"]
    for entry, info, verdict in entries:
        source = info["build"].get("source")
        body.append(f'<section class="card" id="{esc(entry.name)}"><h2>{esc(entry.name)}</h2>'
                    f'<p><code>{esc(entry.prefix)}</code> — format {esc(info["format_version"])}, {esc(info["kind"])}'
                    + (f" ({esc(source)} source)" if source else "") +
                    f', {esc(info["token_dtype"])} tokens, tokenizer {esc(info["tokenizer"] or "unrecorded")}. '
                    f'<a href="{esc(dataset_url(entry.name))}">samples</a> · '
                    f'<a href="{esc(sample_url(entry.name, 0))}">sample 0</a></p>')
        if "views" in info:
            formats = ", ".join(f"{esc(k)} {v:,}" for k, v in info["formats"].items())
            modes = ", ".join(f"{esc(k)} {v:,}" for k, v in info["modes"].items())
            kinds = "; ".join(f"{esc(name)} {k['count']:,} (loss {k['loss']:,}, cfg {k['enable_cfg']:,})"
                              for name, k in info["element_kinds"].items())
            body.append(f"<p>{info['sequences']:,} texts, {info['views']:,} views; elements: {kinds}; "
                        f"images: {formats or 'none'}; modes: {modes or 'none'}.</p>")
        for encoding in info["encodings"]:
            body.append(f'<p>Precached encoding <b>{esc(encoding["name"])}</b>: {encoding["records"]:,} '
                        f'{esc(encoding["modality"])} records of {esc(encoding["encoder"])} ({esc(encoding["dtype"])}, '
                        f'{esc(encoding["store"])}).</p>')
        body.append(_structure(verdict) + _report(info["report"]))
        body.append('<div class="charts">' + "".join(bar_chart(h) for h in info["histograms"]) + "</div></section>")
    return page("Overview", "".join(body), packs=packs)


def _pager(number: int, pages: int, url_of: Callable[[int], str]) -> str:
    """Previous/next links around "page N of M"; ``url_of(page)`` is the URL of a page."""
    links = []
    if number > 0:
        links.append(f'<a href="{esc(url_of(number - 1))}">← previous</a>')
    links.append(f"<span>page {number + 1:,} of {pages:,}</span>")
    if number + 1 < pages:
        links.append(f'<a href="{esc(url_of(number + 1))}">next →</a>')
    return f'<div class="pager">{"".join(links)}</div>'


def _search_form(name: str, query: str = "") -> str:
    return (f'<form class="search" method="get" action="{esc(dataset_url(name, "search"))}">'
            f'<input type="text" name="q" value="{esc(query)}" placeholder="text in the captions and prompts" '
            'maxlength="200" aria-label="search text"> <button type="submit">Search</button></form>')


def _cell(name: str, sample: int, thumb: str | None, caption: str) -> str:
    picture = f'<img src="{esc(thumb)}" alt="sample {sample}">' if thumb else \
        '<div class="textonly">text only</div>'
    return (f'<div class="cell"><a href="{esc(sample_url(name, sample))}">{picture}'
            f'<div><b>#{sample:,}</b> <span class="caption">{esc(caption)}</span></div></a></div>')


def samples_page(entry: Any, number: int, pages: int, cells: list[tuple[int, str | None, str]], total: int) -> str:
    """A page of the sample grid: ``cells`` are (sample, thumbnail URL or None, first caption)."""
    grid = "".join(_cell(entry.name, *cell) for cell in cells)
    pager = _pager(number, pages, lambda page: dataset_url(entry.name, page=page))
    body = (f"<p>{total:,} samples of <code>{esc(entry.prefix)}</code>.</p>{_search_form(entry.name)}"
            f'{pager}<div class="grid">{grid}</div>{pager}')
    return page(f"{entry.name}: samples", body)


def search_page(entry: Any, result: SearchResult | None, note: str | None) -> str:
    """The search form and, when a query was given, what the bounded scan found."""
    body = [_search_form(entry.name, result.query if result else "")]
    if note:
        body.append(f'<p class="note">{esc(note)}</p>')
    if result is not None:
        body.append(f"<p>Scanned samples {result.start:,} to {max(result.end - 1, result.start):,} of "
                    f"{result.total:,} ({result.end - result.start:,} samples) in {result.seconds:.2f} s: "
                    f"{len(result.hits):,} match{'es' if len(result.hits) != 1 else ''}.</p>")
        if not result.complete:
            body.append(f'<p><a href="{esc(dataset_url(entry.name, "search", q=result.query, start=result.end))}">'
                        f"continue from sample {result.end:,} →</a></p>")
        rows = [[f'<a href="{esc(sample_url(entry.name, sample))}">#{sample:,}</a>', esc(text[:300])]
                for sample, text in result.hits]
        if rows:
            body.append(table(["sample", "text"], rows))
    return page(f"{entry.name}: search", "".join(body))


def _element(element: dict[str, Any], thumbs: list[str]) -> str:
    tokens = f"{element['tokens']:,} tokens" if element["tokens"] is not None else "tokens unknown"
    head = (f'<div class="head"><span class="kind">{esc(element["type"])}</span> · {tokens} · '
            f"{esc(element_flags(element))}</div>")
    classes = " ".join(name for name, key in (("loss", "loss"), ("cfg", "enable_cfg")) if element[key])
    if element["type"] == "text":
        text = element["decoded"] if element["decoded"] is not None else str(element["token_ids"])
        total = element["tokens"] - 2  # without the text's start and end markers
        if len(text) > MAX_TEXT_CHARS:
            cut = f"first {MAX_TEXT_CHARS:,} characters of " + (
                f"{len(text):,}" if element["shown_tokens"] == total else
                f"the first {element['shown_tokens']:,} of {total:,} tokens")
        elif element["shown_tokens"] < total:
            cut = f"the first {element['shown_tokens']:,} of {total:,} tokens"
        else:
            cut = ""
        cut = f' <span class="note">({cut})</span>' if cut else ""
        content = f'<div class="text {classes}">{esc(text[:MAX_TEXT_CHARS])}</div>{cut}'
    else:
        j = element["image"]
        content = f'<a href="#image-{j}"><img src="{esc(thumbs[j])}" alt="image {j}"></a> <span>image {j}</span>'
    return f'<div class="element {"loss" if element["loss"] else ""}">{head}{content}</div>'


def sample_page(entry: Any, views: list[dict[str, Any]], images: list[tuple[str, str, str]],
                encodings: list[str], pages_url: str) -> str:
    """One sample: ``views`` are :func:`mmidx.toolkit.sample.describe_sample` of each view shown, ``images``
    (full URL, thumbnail URL, how it is served) of each image, ``encodings`` lines about its encodings."""
    first = views[0]
    index, total = first["sample"], first["samples"]
    links = [f'<a href="{esc(pages_url)}">samples page</a>']
    if index > 0:
        links.insert(0, f'<a href="{esc(sample_url(entry.name, index - 1))}">← #{index - 1:,}</a>')
    if index + 1 < total:
        links.append(f'<a href="{esc(sample_url(entry.name, index + 1))}">#{index + 1:,} →</a>')
    origin = first["origin"]
    facts = [["dataset", f"{esc(entry.name)} <code>{esc(entry.prefix)}</code>"],
             ["source type", esc(first["source"] or "unrecorded")],
             ["origin", esc(f"{origin['file']} row {origin['row']}") if origin else "not recorded"],
             ["views", f"{first['views']:,}" + (f" (the first {MAX_VIEWS} shown)" if first["views"] > MAX_VIEWS
                                                 else "")],
             ["images", f"{len(first['images']):,}"],
             ["tokens when packed (view 0)", f"{first['tokens']:,}" if first["tokens"] is not None else "unknown"]]
    if first["extra"]:
        extra = json.dumps(first["extra"], ensure_ascii=False)
        facts.append(["extra", esc(extra[:MAX_EXTRA_CHARS] + ("…" if len(extra) > MAX_EXTRA_CHARS else ""))])
    if first["tokenizer_note"]:
        facts.append(["texts", esc(f"shown as token ids: {first['tokenizer_note']}")])
    body = [f'<div class="pager">{" ".join(links)}</div>', table(["", ""], facts),
            '<p class="legend note">Text with loss is shaded; a dashed green outline marks elements CFG may drop '
            "(enable_cfg); a black left bar marks every element with loss.</p>"]
    if encodings:
        body.append("<h2>Precached encodings</h2><ul>" + "".join(f"<li>{esc(line)}</li>" for line in encodings)
                    + "</ul>")
    thumbs = [thumb for _, thumb, _ in images]
    for described in views:
        elements = described["elements"]
        body.append(f"<h2>View {described['view']} of {described['views']}</h2>")
        body += [_element(element, thumbs) for element in elements[:MAX_ELEMENTS]]
        if len(elements) > MAX_ELEMENTS:
            body.append(f'<p class="note">… and {len(elements) - MAX_ELEMENTS:,} more elements.</p>')
    if images:
        body.append("<h2>Images</h2>")
    for j, ((full, _, served), image) in enumerate(zip(images, first["images"], strict=True)):
        body.append(f'<figure id="image-{j}"><img class="full" src="{esc(full)}" alt="image {j}">'
                    f'<figcaption>image {j}: {image["width"]}×{image["height"]} {esc(image["format"])} '
                    f'{esc(image["mode"])}, {image["bytes"]:,} bytes stored; {esc(served)}</figcaption></figure>')
    return page(f"{entry.name}: sample {index:,} of {total:,}", "".join(body))


def mixture_section(report: dict[str, Any]) -> str:
    """The mixture report (``mmidx.index.mixture``) drawn: each group's share of the packed samples over
    the packs (one line per group, dashed lines where a phase starts), then per phase and group the samples,
    share and weight, and the packs where each group's epochs ended."""
    width, height, left, bottom = 720, 200, 34, 18
    over = report["share_over_packs"]
    packs = max(report["packs"], 1)
    palette = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
    x = lambda pack: left + (width - left) * pack / packs  # noqa: E731
    y = lambda share: (height - bottom) * (1 - share)  # noqa: E731
    lines, legend = [], []
    for number, (name, shares) in enumerate(over["share"].items()):
        colour = palette[number % len(palette)]
        points = " ".join(f"{x(p):.1f},{y(v):.1f}" for p, v in zip(over["pack"], shares, strict=True))
        lines.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.5" points="{points}">'
                     f"<title>{esc(name)}</title></polyline>")
        legend.append(f'<span><svg width="10" height="10" role="img"><rect width="10" height="10" fill="{colour}"/>'
                      f"</svg> {esc(name)}</span>")  # a swatch, not a style attribute: the CSP refuses inline styles
    for phase in report["phases"][1:]:
        at = x(phase["packs"][0])
        lines.append(f'<line x1="{at:.1f}" x2="{at:.1f}" y1="0" y2="{height - bottom}" stroke="#555" '
                     f'stroke-dasharray="4 3"><title>phase {phase["phase"]} from pack {phase["packs"][0]:,}</title>'
                     "</line>")
    axis = (f'<text x="0" y="10">100%</text><text x="0" y="{height - bottom}">0%</text>'
            f'<text x="{left}" y="{height - 3}">pack 0</text>'
            f'<text x="{width}" y="{height - 3}" text-anchor="end">pack {report["packs"]:,}</text>')
    chart = (f'<div class="chart"><div class="title">share of packed samples per group over the packs</div>'
             f'<svg viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img">{axis}'
             f'{"".join(lines)}</svg><div>{" ".join(legend)}</div></div>')
    rows = [[f"{phase['phase']}", f"{phase['packs'][0]:,}–{phase['packs'][1]:,}", esc(name), f"{group['samples']:,}",
             f"{group['share']:.2%}", f"{group['weight']:.2%}"]
            for phase in report["phases"] for name, group in phase["groups"].items()]
    epochs = [[esc(name), f"{e['taken']:,} of {e['samples']:,}", f"{e['completed']}",
               esc(", ".join(f"{pack:,}" for pack in e["ended_at_pack"]) or "–")]
              for name, e in report["epochs"].items()]
    return ("<h2>Mixture</h2>" + chart + table(["phase", "packs", "group", "samples", "share", "weight"], rows,
                                                {3, 4, 5})
            + table(["group", "samples taken", "epochs", "ended at pack"], epochs, {2}))


def packs_page(stats: dict[str, Any], rows: list[tuple[int, int, int]], max_num_tokens: int, number: int,
               pages: int, fill: Histogram, note: str, mixture: str = "") -> str:
    """A page of the pack list: ``rows`` are (pack, samples, planned tokens); ``mixture``: the drawn
    mixture report (``mixture_section``), on the first page."""
    facts = [[esc(key), esc(f"{value:,}" if isinstance(value, int) else value)] for key, value in stats.items()
             if isinstance(value, (int, float, str))]
    listed = [[f'<a href="/pack/{pack}">pack {pack:,}</a>', f"{samples:,}", f"{tokens:,}",
               f"{tokens / max_num_tokens:.1%}"] for pack, samples, tokens in rows]
    body = (f'<p class="note">{esc(note)}; fill is the planned tokens (the samples\' view sizes as the index '
            f"counted them, before CFG dropout) over max_num_tokens = {max_num_tokens:,}.</p>"
            f'<div class="charts">{bar_chart(fill)}</div>{table(["statistic", "value"], facts)}' + mixture
            + _pager(number, pages, lambda page: f"/packs?page={page}")
            + table(["pack", "samples", "planned tokens", "fill"], listed, {1, 2, 3}))
    return page("Packs", body)


def pack_page(layout: PackLayout, packs: int) -> str:
    """One pack: its attention layout and its samples, each linked to its page."""
    k = layout.pack
    links = [f'<a href="/pack/{k - 1}">← pack {k - 1:,}</a>' if k > 0 else "",
             f'<a href="/packs?page={k // 100}">all packs</a>',
             f'<a href="/pack/{k + 1}">pack {k + 1:,} →</a>' if k + 1 < packs else ""]
    legend = "".join(f'<span><svg class="swatch" viewBox="0 0 12 12"><rect width="12" height="12" fill="{colour}"/>'
                     f"</svg>{esc(name)}</span>" for name, colour in LEGEND)
    rows = [[f"s{s.position}", esc(s.group), f'<a href="{esc(sample_url(s.dataset, s.sample))}">{esc(s.dataset)} '
             f"#{s.sample:,}</a>", f"{s.view}", f"{s.tokens:,}",
             esc(" ".join(f"{split.mode}:{split.kind}:{split.tokens:,}" for split in s.splits))]
            for s in layout.samples]
    body = (f'<div class="pager">{" ".join(link for link in links if link)}</div>'
            f"<p>{layout.tokens:,} tokens in {len(layout.samples):,} samples: fill "
            f"{layout.tokens / layout.max_num_tokens:.1%} of max_num_tokens = {layout.max_num_tokens:,} "
            "(the batch as the loader builds it, CFG dropout applied).</p>"
            f'<p class="legend">{legend}</p>'
            '<p class="note">Queries down, keys across, split-scaled axes; a coloured cell may attend (the '
            "key's kind), white is blocked. Hover a split or a row for its sample and split; click a row to "
            f"open the sample.</p>{layout.svg}"
            + table(["", "group", "sample", "view", "tokens", "splits (attention mode:kind:tokens)"], rows, {3, 4}))
    return page(f"Pack {k:,} of {packs:,}", body)


def error_page(status: int, message: str) -> str:
    """The page of a refused request: its status and one line saying why."""
    return page(f"{status}: {message.split(':', 1)[0]}", f"<p>{esc(message)}</p><p><a href=\"/\">overview</a></p>",
                packs=True)



def _hex(colour: tuple[int, int, int]) -> str:
    return "#" + "".join(f"{c:02x}" for c in colour)


LEGEND = [*((name, _hex(colour)) for name, colour in COLOURS.items()), ("loss", _hex(LOSS_COLOUR)),
          ("blocked", "#ffffff")]
