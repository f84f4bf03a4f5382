"""``mmidx view``: serve a local, read-only web viewer of datasets and packs (:mod:`mmidx.toolkit.view`)."""

from __future__ import annotations

import argparse
import errno
import sys
from typing import Any

from mmidx.cli.common import (
    PATHS_HELP,
    PREFIX_OR_DATA_YAML,
    add_cache_arguments,
    add_command,
    add_geometry_arguments,
    dataset_prefix,
    geometry_args,
)
from mmidx.toolkit.view import limits


def cmd_view(args: argparse.Namespace) -> int:
    from mmidx.config import is_data_yaml
    from mmidx.toolkit.view.app import bind, is_loopback, serve, url_of  # one line when the web stack is missing
    from mmidx.toolkit.view.catalog import Catalog

    paths = [path if is_data_yaml(path) else dataset_prefix(path) for path in args.paths]
    catalog = Catalog(paths, geometry=geometry_args(args))
    try:
        sock = bind(args.host, args.port)
    except OSError as error:  # in use, or not an address of this machine
        why = "in use: pick another --port (0: any free one)" if error.errno == errno.EADDRINUSE else \
            f"not possible: {error.strerror or error}"
        print(f"mmidx view: listening on {args.host}:{args.port} is {why}", file=sys.stderr)
        return 1
    if not is_loopback(args.host):
        print(f"mmidx view: warning: listening on {args.host}, which other machines may reach: anyone who can "
              "connect can read these datasets (the default, 127.0.0.1, is this machine only)", file=sys.stderr)
    print(f"mmidx view: {len(catalog.datasets)} dataset{'s' if len(catalog.datasets) != 1 else ''} at "
          f"{url_of(sock)} (Ctrl-C to stop)", flush=True)
    serve(catalog, sock, time_limit=args.time_limit, request_timeout=args.request_timeout,
          keep_alive=args.keep_alive, per_client=args.connections_per_client)
    return 0


def _port(text: str) -> int:
    """A TCP port number, 0 to 65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0 to 65535; 0: any free port)")
    return port


def _positive(kind: type) -> Any:
    """An argparse type: a number of ``kind`` greater than 0."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            value = 0
        if not value > 0:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number greater than 0")
        return value

    return parse


def register(commands: Any) -> None:
    """Add ``mmidx view`` to the command line's subcommands."""
    sub = add_command(commands, "view", cmd_view,
                      "Serve a local, read-only web viewer: overview histograms, samples, packs and their attention.")
    sub.add_argument("paths", nargs="+", metavar=PREFIX_OR_DATA_YAML, help=PATHS_HELP)
    sub.add_argument("--host", default="127.0.0.1",
                     help="address to listen on; anything but loopback makes the datasets readable from other "
                          "machines (a warning says so)")
    sub.add_argument("--port", type=_port, default=8765, help="port to listen on (0: any free port)")
    add_geometry_arguments(sub)  # the packs of a data YAML
    add_cache_arguments(sub)
    group = sub.add_argument_group("limits", "what one client may take of the viewer, so that slow, greedy or "
                                             "absurd requests cannot stall it; each says what happens at its limit")
    group.add_argument("--time-limit", type=_positive(float), default=limits.TIME_LIMIT, metavar="SECONDS",
                        help="a page not ready in this time is answered 503; its work goes on and a reload gets it")
    group.add_argument("--request-timeout", type=_positive(float), default=limits.REQUEST_TIMEOUT, metavar="SECONDS",
                        help="a request must arrive whole (headers and body) within this time of the connection "
                             "opening or the previous response, or the connection is closed")
    group.add_argument("--keep-alive", type=_positive(float), default=limits.KEEP_ALIVE, metavar="SECONDS",
                        help="an idle keep-alive connection is closed after this time")
    group.add_argument("--connections-per-client", type=_positive(int), default=limits.PER_CLIENT, metavar="N",
                        help="connections one client may hold (every loopback address is one client): a new one "
                             "closes an idle one, else the oldest stalled one (once stalled ones are over half), else "
                             "the busiest")
