"""Run ``mmidx`` command lines from a shell with mmidx's imports done once: a small fork server.

Every ``mmidx`` process pays seconds of imports (torch, transformers) before it does anything, so a
test that runs the README's shell blocks as a user would (in ``bash``, every command a process)
would spend most of its time importing. This module serves those commands instead: ``serve`` imports
the command line and what its commands import, then, for each connection, forks a child that runs
``mmidx.cli.main`` with the caller's arguments, folder, environment and standard streams. ``client``
is the ``mmidx`` executable a test puts on ``PATH``: it passes its streams to the server and exits with
the command's status. The command is ``mmidx.cli.main``, the console script's own entry point.

    python tests/support/cli_server.py SOCKET         # serve until killed
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path

# what the commands import: mmidx's modules (with torch) and transformers (the tokenizer's)
PRELOADED = ("mmidx.cli", "mmidx.toolkit.bench", "mmidx.ingest", "mmidx.toolkit.export", "mmidx.toolkit.sample",
             "mmidx.toolkit.show",             "mmidx.sources", "transformers")

CLIENT = """#!{python}
import json, os, socket, sys
connection = socket.socket(socket.AF_UNIX)
connection.connect({socket!r})
socket.send_fds(connection, [b"x"], [0, 1, 2])
connection.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode())
connection.shutdown(socket.SHUT_WR)
status = connection.recv(16)
sys.exit(int(status) if status else 1)
"""


def client(path: str | os.PathLike, socket_path: str) -> None:
    """Write the ``mmidx`` executable that runs its command line in the server at ``socket_path``."""
    with open(path, "w") as stream:
        stream.write(CLIENT.format(python=sys.executable, socket=os.fspath(socket_path)))
    os.chmod(path, 0o755)


def _receive(connection: socket.socket) -> tuple[list[int], dict]:
    _, fds, _, _ = socket.recv_fds(connection, 1, 3)
    chunks = []
    while chunk := connection.recv(1 << 16):
        chunks.append(chunk)
    return fds, json.loads(b"".join(chunks))


def _run_child(connection: socket.socket, fds: list[int], request: dict) -> None:
    """In the forked child: take the caller's streams, folder and environment, run the command, report."""
    from mmidx.cli import main

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = ["mmidx", *request["argv"]]
    try:
        status = main(request["argv"])
    except SystemExit as exit_:  # argparse: --help (0), usage errors (2)
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # main lets nothing out; if it did, say so, and never return to the server's loop
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDWR)
    for target in range(3):  # the caller's streams are done: its pipes close now, not after a teardown
        os.dup2(null, target)
    connection.sendall(str(status).encode())
    os._exit(status)  # no interpreter teardown: seconds with torch loaded, and nothing of the command's left


def serve(socket_path: str) -> None:
    """Import the command line and what its commands use, then fork a child per connection."""
    for module in PRELOADED:
        importlib.import_module(module)
    server = socket.socket(socket.AF_UNIX)
    server.bind(socket_path)
    server.listen()
    print("ready", flush=True)
    while True:
        connection, _ = server.accept()
        fds, request = _receive(connection)
        if os.fork() == 0:
            server.close()
            _run_child(connection, fds, request)
        for fd in fds:
            os.close(fd)
        connection.close()
        while True:  # reap finished children
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


@contextlib.contextmanager
def running(folder: Path) -> Iterator[dict[str, str]]:
    """A server for the duration of the block, and the environment whose ``mmidx`` (in ``folder/bin``) uses it."""
    root = Path(__file__).resolve().parents[2]  # the repository: mmidx from this checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.fspath(root), os.environ.get("PYTHONPATH", "")]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    socket_folder = tempfile.mkdtemp(prefix="mmidx-cli-")  # a short path: socket paths are limited to ~100 bytes
    socket_path = os.path.join(socket_folder, "socket")
    with open(folder / "cli_server.log", "w") as log:
        server = subprocess.Popen([sys.executable, __file__, socket_path], env=env, stdout=subprocess.PIPE,
                                  stderr=log, text=True, start_new_session=True)  # its own group: see below
    try:
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the mmidx command server did not start: {(folder / 'cli_server.log').read_text()}")
        (folder / "bin").mkdir(exist_ok=True)
        client(folder / "bin" / "mmidx", socket_path)
        yield {**env, "PATH": os.pathsep.join([os.fspath(folder / "bin"), env.get("PATH", "")])}
    finally:  # the server and any command still running (a block that timed out), with their workers
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
        shutil.rmtree(socket_folder, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
