"""The outcome of fetching one URL: ``ok`` or exactly one failure class, and which classes are transient.

Every row of a URL table ends in one class. A failure becomes the build's skip reason ``fetch:<class>``
(counted in ``PREFIX.report.json`` with examples and the description below), so samples plus skips equal
rows; the per-row ledger (``PREFIX.fetch.parquet``) keeps each row's class, HTTP status and attempts.

Transient classes (a later try may succeed: timeouts, resets, DNS, HTTP 429 and 5xx) are retried with
backoff while fetching and again by ``mmidx build --retry-failed``; permanent ones (404/410/403, not an
image, too large, opted out, bad redirects) never are.
"""

from __future__ import annotations

from typing import Any

OK = "ok"

OUTCOMES = {
    "not_found": "HTTP 404 or 410: the image is gone (requested once, never retried)",
    "http_error": "any other HTTP error status: 403 and other 4xx are not retried; 429 and 5xx are retried "
                  "with backoff (honouring Retry-After) and counted here when every try failed",
    "timeout": "no whole response within --timeout seconds (one deadline per try for connecting, headers and "
               "body, so a dripping body fails on time), after retries",
    "connection": "connection refused, reset or closed early, or a body shorter than its Content-Length, "
                  "after retries",
    "dns": "the host name did not resolve, after retries",
    "too_large": "a body above --max-image-bytes (stopped while streaming) or an image whose header declares "
                 "more than --max-image-pixels pixels (refused before decoding)",
    "not_an_image": "a body whose first bytes are not an image format's signature (an HTML page, JSON...)",
    "decode_error": "bytes with an image signature that do not decode (truncated or corrupt)",
    "opted_out": "an X-Robots-Tag header saying noai or noimageai (for every agent or for this one): the body "
                 "was not read (--ignore-opt-out fetches it anyway)",
    "redirects": "more than 5 redirects, a redirect loop, or a redirect to a scheme other than http(s)",
    "invalid_url": "a URL cell that is empty or not an absolute http(s) URL",
}

OPT_OUT_IGNORED = "fetch:opt_out_ignored"
WARNING_OUTCOMES = {
    OPT_OUT_IGNORED: "row whose server opted out of AI use (X-Robots-Tag noai/noimageai), stored anyway because "
                     "of --ignore-opt-out",
}

TRANSIENT = frozenset({"timeout", "connection", "dns"})
RETRIED_STATUSES = frozenset({429, 500, 502, 503, 504, 507, 508, 509, 520, 521, 522, 523, 524})
WARN_FAILURE_RATE = 0.20


def skip_reason(outcome: str) -> str:
    """The build's skip reason of a failure class: ``fetch:<class>``."""
    return f"fetch:{outcome}"


SKIP_REASONS = {skip_reason(outcome): text for outcome, text in OUTCOMES.items()}


def is_transient(outcome: str, status: int | None) -> bool:
    """Whether a fetch that ended in ``outcome`` with HTTP ``status`` may succeed if tried again."""
    return outcome in TRANSIENT or (outcome == "http_error" and (status in RETRIED_STATUSES or
                                                                 (status is not None and status >= 500)))


def failure_warning(report: dict[str, Any]) -> str | None:
    """A warning line when more than 20% of a build's rows failed to download, else None."""
    failed = sum(entry["count"] for reason, entry in report.get("skips", {}).items() if reason in SKIP_REASONS)
    rows = report.get("rows", 0)
    if not rows or failed / rows <= WARN_FAILURE_RATE:
        return None
    return (f"  warning: {failed / rows:.1%} of the rows failed to download (more than {WARN_FAILURE_RATE:.0%}); "
            "see the fetch:* classes above and the per-row ledger PREFIX.fetch.parquet (transient ones: "
            "rerun with --retry-failed)")
