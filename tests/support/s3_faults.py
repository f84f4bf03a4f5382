"""A TCP proxy on 127.0.0.1 in front of an S3 server that answers the first ``failures`` connections' first
request with S3's throttling answer (503 SlowDown) and closes them; later connections reach the server."""

import socket
import threading

SLOW_DOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
             b"<Message>Please reduce your request rate.</Message></Error>")


class ThrottlingProxy:
    """Counts the requests it throttled (``throttled``); ``stop()`` closes its listener."""

    def __init__(self, target: tuple[str, int], failures: int):
        self.target, self.failures, self.throttled = target, failures, 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def stop(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # stopped
                return
            if self.throttled < self.failures:
                self.throttled += 1
                threading.Thread(target=self._throttle, args=(client,), daemon=True).start()
                continue
            server = socket.create_connection(self.target)
            threading.Thread(target=_pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=_pipe, args=(server, client), daemon=True).start()

    @staticmethod
    def _throttle(client: socket.socket) -> None:
        with client:
            head = b""
            while b"\r\n\r\n" not in head and (chunk := client.recv(1 << 16)):
                head += chunk
            body = b"" if head.startswith(b"HEAD ") else SLOW_DOWN
            client.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(SLOW_DOWN) if body else 0, body))


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while chunk := source.recv(1 << 16):
            sink.sendall(chunk)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
