"""The viewer's limits on what a client controls, with their defaults (docs/guide/viewer-security.md).

Plain numbers with no web stack to import, so the command line's options can default to them.
"""

REQUEST_TIMEOUT = 10.0
"""Seconds a request has to arrive whole (headers and body), from the connection's opening or the previous response."""
KEEP_ALIVE = 5.0
"""Seconds an idle keep-alive connection is kept."""
PER_CLIENT = 256
"""Connections one client address may hold; a new one closes that client's oldest stalled or idle one."""
TIME_LIMIT = 20.0
"""Seconds a page's work has before the request is answered 503 (the work goes on; a reload gets its result)."""
WORKERS = 8
"""Threads doing page work: at most this many pages are computed at once."""
MAX_HEAD = 16 * 1024
"""Bytes a request's head (request line and headers, line ends included) may have: a larger one is answered 400."""
