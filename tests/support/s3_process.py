"""A second S3 server (moto's) on 127.0.0.1 in a process of its own: moto's servers in one process share their
buckets, so a store that must hold other objects at the same keys as the ``s3`` fixture's runs apart."""

import os
import subprocess
import sys

import boto3

SERVE = """
import logging, sys, threading
from moto.server import ThreadedMotoServer
logging.getLogger("werkzeug").setLevel(logging.ERROR)
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print("%s:%d" % server.get_host_and_port(), flush=True)
sys.stdin.read()  # until the test closes its end
server.stop()
"""


class S3Process:
    """``endpoint`` (host:port), ``client`` (boto3's, for it), ``upload(prefix, key)``; ``stop()`` ends it."""

    def __init__(self, timeout_s: float = 60.0):
        self._process = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         text=True)
        try:
            self.endpoint = _first_line(self._process, timeout_s)
        except BaseException:
            self.stop()
            raise
        self.client = boto3.client("s3", endpoint_url=f"http://{self.endpoint}")

    def upload(self, prefix: str, key: str) -> None:
        """Put every file of the local dataset ``prefix`` at ``key`` in the bucket ``mmidx``."""
        from mmidx.read.dataset import dataset_files

        for path in dataset_files(prefix):
            self.client.upload_file(str(path), "mmidx", key + path.name[len(os.path.basename(prefix)):])

    def stop(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _first_line(process: subprocess.Popen, timeout_s: float) -> str:
    """The server's address, which it prints once listening; an error past ``timeout_s``."""
    import selectors

    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout_s):
            raise TimeoutError(f"the second S3 server did not start within {timeout_s:.0f} s")
    line = process.stdout.readline().strip()
    if not line:
        raise RuntimeError(f"the second S3 server exited (status {process.wait()}) before listening")
    return line
