"""A scripted streaming server of the common kind: one asyncio loop, each request stamped when the loop reads it.

The other truth for benchmarks/ttft_at_scale.py (beside `stampserver.py`, a thread per connection
whose arrivals are the kernel's stamps): like most servers' own logs, this one stamps a request's
arrival when its event loop got round to reading it, and a token when it wrote it, both on the
monotonic clock (the clients' own). Its first token is written `ttft_s` after that arrival and each
further one `tpot_s` apart, as the loop's timers allow; the truth keeps what it did
(`ttft_s`, `token_offsets_s` from the arrival), not what it meant to. A request's own `x-request-id`
names its answer (else the server numbers them); Anthropic Messages or OpenAI Chat Completions
streams (`fakeserver`'s, without the role-only chunk), chunked, keep-alive.

`python tests/loopserver.py --truth FILE` serves until SIGTERM (its base URL on the first line of
stdout), then writes its truth as JSON lines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from itertools import count
from typing import Any

from fakeserver import anthropic_stream, chat_stream, server_arguments

_HEADERS = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nx-request-id: {}\r\n\r\n"


class _Connection(asyncio.Protocol):
    def __init__(self, server: _Server) -> None:
        self.server = server
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        arrival, wall = time.monotonic(), time.time()
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")[1:]
            fields = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in head)}
            size = end + 4 + int(fields.get("content-length", "0"))
            if len(self.buffer) < size:
                return
            self.buffer = self.buffer[size:]
            self.server.answer(self, fields.get("x-request-id"), arrival, wall)


class _Server:
    def __init__(self, ttft_s: float, tpot_s: float, tokens: int, protocol: str) -> None:
        self.ttft_s, self.tpot_s, self.tokens, self.protocol = ttft_s, tpot_s, tokens, protocol
        self.truth: list[dict[str, Any]] = []
        self.ids = count(1)

    def answer(self, conn: _Connection, named: str | None, arrival: float, wall: float) -> None:
        request_id = named or f"msg_loop{next(self.ids):05d}"
        tokens = [f"t{i} " for i in range(self.tokens)]
        writes = (chat_stream(tokens, 1.0, 1.0, role_chunk=False, completion_id=request_id)
                  if self.protocol == "openai-chat" else anthropic_stream(tokens, 1.0, 1.0, message_id=request_id))
        record: dict[str, Any] = {"request_id": request_id, "arrival": wall, "token_offsets_s": []}
        assert conn.transport is not None
        transport = conn.transport
        transport.write(_HEADERS.format(request_id).encode())
        loop = asyncio.get_running_loop()
        # Consecutive writes with no delay between them go out with the token before them.
        groups: list[list[bytes]] = [[]]
        for delay, data in writes:
            if delay:
                groups.append([])
            groups[-1].append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        groups[-1].append(b"0\r\n\r\n")
        transport.write(b"".join(groups[0]))

        def write(k: int) -> None:
            if transport.is_closing():
                return
            record["token_offsets_s"].append(time.monotonic() - arrival)
            transport.write(b"".join(groups[k]))
            if k + 1 < len(groups):
                loop.call_at(arrival + self.ttft_s + k * self.tpot_s, write, k + 1)
            else:
                record["ttft_s"] = record["token_offsets_s"][0]
                self.truth.append(record)

        loop.call_at(arrival + self.ttft_s, write, 1)


async def _serve(args: argparse.Namespace) -> list[dict[str, Any]]:
    server = _Server(args.ttft_s, args.tpot_s, args.tokens, args.protocol)
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(lambda: _Connection(server), "127.0.0.1", 0, backlog=4096)
    print(f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    listener.close()
    return server.truth


def main() -> int:
    """Serve until SIGTERM, then write the truth as JSON lines."""
    args = server_arguments(__doc__)
    truth = asyncio.run(_serve(args))
    with open(args.truth, "w") as out:
        out.write("".join(json.dumps(t) + "\n" for t in truth))
    return 0


if __name__ == "__main__":
    sys.exit(main())
