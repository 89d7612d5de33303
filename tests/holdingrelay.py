"""A pass-through relay for tests: forwards each request to an upstream server on loopback, as LiteLLM does in
front of a model server, and changes the timing in two known ways.

It holds the response's status line and headers until the first token event (`content_block_delta`, Anthropic's)
has arrived from upstream and sends them with it, and it delays everything it forwards by `delay_s` (a delay line:
each piece leaves `delay_s` after it arrived). So through it, TTFB = TTFT, and both are the direct TTFT + `delay_s`
(plus a fresh loopback connection: it answers `Connection: close`), while the gaps between tokens are unchanged.
"""

from __future__ import annotations

import queue
import socket
import socketserver
import threading
import time
from typing import Any

FIRST_TOKEN = b"content_block_delta"


def _without_connection(head: bytes) -> bytes:
    """The head's lines without the hop-by-hop connection headers, plus `Connection: close`."""
    lines = [line for line in head.split(b"\r\n")
             if not line.lower().startswith((b"connection:", b"keep-alive:"))]
    return b"\r\n".join([*lines, b"Connection: close"]) + b"\r\n\r\n"


class HoldingRelay:
    """`with HoldingRelay(port, delay_s) as relay:` a relay at `relay.url` in front of 127.0.0.1:`port`."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        relay = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                relay.forward(self.request)

        self.upstream = ("127.0.0.1", upstream_port)
        self.delay_s = delay_s
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.requests = 0

    def forward(self, client: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = client.recv(65536)
            if not chunk:
                return
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        while len(body) < length:
            body += client.recv(65536)
        self.requests += 1
        with socket.create_connection(self.upstream) as up:
            up.sendall(_without_connection(head) + body)
            got = b""
            while FIRST_TOKEN not in got.partition(b"\r\n\r\n")[2]:
                chunk = up.recv(65536)
                if not chunk:
                    break
                got += chunk
            answer_head, _, rest = got.partition(b"\r\n\r\n")
            # A delay line from here on: each piece leaves `delay_s` after it arrived, so the gaps stay as they were.
            pieces: queue.Queue[tuple[float, bytes]] = queue.Queue()
            pieces.put((time.monotonic(), _without_connection(answer_head) + rest))

            def read() -> None:
                while chunk := up.recv(65536):
                    pieces.put((time.monotonic(), chunk))
                pieces.put((time.monotonic(), b""))

            threading.Thread(target=read, daemon=True).start()
            while True:
                arrived, piece = pieces.get()
                time.sleep(max(0.0, arrived + self.delay_s - time.monotonic()))
                if not piece:
                    break
                client.sendall(piece)
        client.close()

    def __enter__(self) -> HoldingRelay:
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
