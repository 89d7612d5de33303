"""A server whose true TTFT does not depend on when it got round to a request: kernel-stamped arrivals.

A server's own log (the simulator's truth file included) stamps a request when its
event loop reads it; under a burst of new connections that can be many milliseconds
after the bytes arrived, and a client that measured correctly then looks late. Here
every request's arrival is the kernel's receive time of its last byte (`SO_TIMESTAMPNS`
on the accepted socket, read with `recvmsg`), its first token is written `ttft_s`
after that arrival and each further token `tpot_s` apart, and the truth keeps both
stamps as written, so `first_token - arrival` is the server's time even when a thread
ran late. One thread per connection (keep-alive), Anthropic Messages streams from
`fakeserver.anthropic_stream`, each named by its id in `x-request-id` and `message_start`.
The truth also keeps when each token was written (`token_writes`): a client whose first
token's stamp matches a later write's read it late (benchmarks/startup_burst.py).

`python tests/stampserver.py --truth FILE` serves until SIGTERM (its base URL on the
first line of stdout) and then writes its truth as JSON lines: the benchmark's server.

`read_delay_s` holds each new connection that long before its first read, with a
small receive buffer until then (`rcvbuf`): a large request cannot be written until
the server starts reading, the client-side wait a request's t0 must not include.
`early_headers` writes the first response's headers as soon as the connection is
accepted, before the request is read: they reach the client before its write returns.
`protocol = "openai-chat"` streams Chat Completions instead, and a request's own
`x-request-id` names its answer (a client that keeps no response header can be joined).
`headers_with_first` holds the headers and the events before the first token back and
writes them with it (as servers that send nothing until the first token do).
The truth's `ttft_s` and `token_offsets_s` are on the monotonic clock, the clients' own: this
machine's wall clock may be stepped (here +0.5 ms every 0.1 s), and `first_token - arrival`
on it then runs 0.5% long.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from fakeserver import anthropic_stream, chat_stream, server_arguments

_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
# A token write's time is the kernel's stamp of it leaving (reported on the error queue), not the clock read before
# the write: with thousands of threads, one can lose the interpreter between the two. Software stamps, their
# reports only, no receive stamps of this kind (OPT_RX_FILTER), asked for per write.
_TIMESTAMPING = getattr(socket, "SO_TIMESTAMPING", 37)
_REPORT_SENDS = (1 << 4) | (1 << 11) | (1 << 17)  # SOFTWARE | OPT_TSONLY | OPT_RX_FILTER
_STAMP_SEND = [(socket.SOL_SOCKET, _TIMESTAMPING, struct.pack("I", 1 << 1))]  # TX_SOFTWARE
_HEADERS = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@dataclass
class StampServer:
    ttft_s: float = 0.05
    tpot_s: float = 0.005
    tokens: int = 4
    read_delay_s: float = 0.0
    rcvbuf: int | None = None
    early_headers: bool = False
    headers_with_first: bool = False
    protocol: str = "anthropic"  # or "openai-chat" (no role-only chunk: the first chunk with choices is a token)
    truth: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._ids = count(1)
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.rcvbuf is not None:  # inherited by accepted sockets
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(1024)
        self.base_url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def ttfts(self, requests: int, timeout_s: float = 10.0) -> dict[str, float]:
        """Each request's true TTFT by its id, once `requests` are noted (a request is noted after its last write,
        which the client may have read already)."""
        deadline = time.monotonic() + timeout_s
        while len(self.truth) < requests and time.monotonic() < deadline:
            time.sleep(0.01)
        with self._lock:
            return {t["request_id"]: t["ttft_s"] for t in self.truth}

    def __enter__(self) -> StampServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.SOL_SOCKET, _TIMESTAMPNS, 1)
        with contextlib.suppress(OSError):  # Linux 6.12+: token writes carry the kernel's send stamp
            conn.setsockopt(socket.SOL_SOCKET, _TIMESTAMPING, _REPORT_SENDS)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.read_delay_s:
            time.sleep(self.read_delay_s)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)  # then read at full speed
        buffered = b""
        with conn:
            try:
                headers_sent = self.early_headers
                if headers_sent:
                    conn.sendall(_HEADERS)
                while True:
                    request = _read_request(conn, buffered)
                    if request is None:
                        return
                    size, arrival, arrival_mono, named, buffered = request
                    self._answer(conn, size, arrival, arrival_mono, headers_sent, named)
                    headers_sent = False
            except OSError:
                return

    def _answer(self, conn: socket.socket, size: int, arrival: float, arrival_mono: float, headers_sent: bool,
                named: str | None = None) -> None:
        """`named`: the request's own `x-request-id`, the id of its answer (else one of the server's)."""
        request_id = named or f"msg_stamp{next(self._ids):05d}"
        # Non-zero delays mark the token writes; their times come from the arrival, not from these.
        tokens = [f"t{i} " for i in range(self.tokens)]
        writes = (chat_stream(tokens, 1.0, 1.0, role_chunk=False, completion_id=request_id)
                  if self.protocol == "openai-chat" else anthropic_stream(tokens, 1.0, 1.0, message_id=request_id))
        held = b"" if headers_sent else _HEADERS[:-2] + f"x-request-id: {request_id}\r\n\r\n".encode()
        if held and not self.headers_with_first:
            conn.sendall(held)
            held = b""
        token_writes: list[float] = []
        offsets: list[float] = []
        due = arrival_mono + self.ttft_s
        for i, (delay, data) in enumerate(writes):
            held += f"{len(data):x}\r\n".encode() + data + b"\r\n" + (b"0\r\n\r\n" if i == len(writes) - 1 else b"")
            if self.headers_with_first and not delay and not token_writes:
                continue
            if delay:
                time.sleep(max(0.0, due - time.monotonic()))
                token_writes.append(time.time())
                offsets.append(_sent_stamped(conn, held) - arrival_mono)
                due += self.tpot_s
            else:
                conn.sendall(held)
            held = b""
        with self._lock:
            self.truth.append({"request_id": request_id, "arrival": arrival, "first_token": token_writes[0],
                               "token_writes": token_writes, "ttft_s": offsets[0], "token_offsets_s": offsets,
                               "bytes": size})


def _read_request(conn: socket.socket, buffered: bytes) -> tuple[int, float, float, str | None, bytes] | None:
    """(request size, kernel arrival of its last byte, the same on the monotonic clock, its x-request-id, bytes
    after it) or None at the connection's end."""
    data, arrival, mono = buffered, time.time(), time.monotonic()
    while b"\r\n\r\n" not in data or len(data) < _length(data):
        chunk, arrival, mono = _recv_stamped(conn)
        if not chunk:
            return None
        data += chunk
    size = _length(data)
    return size, arrival, mono, _header(data, b"x-request-id"), data[size:]


def _length(data: bytes) -> int:
    """Headers plus Content-Length; large until the headers are complete."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return 1 << 62
    length = _header(data, b"content-length")
    return end + 4 + (int(length) if length else 0)


def _header(data: bytes, wanted: bytes) -> str | None:
    """The value of the complete request head's header `wanted` (lower case), or None."""
    for line in data[:data.find(b"\r\n\r\n")].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == wanted:
            return value.strip().decode("latin-1")
    return None


def _sent_stamped(conn: socket.socket, data: bytes) -> float:
    """Write `data`; when its last byte left, on the monotonic clock: the kernel's send stamp where it gives one,
    else the clock just before the write."""
    with contextlib.suppress(OSError):  # a stamp that came too late for the write before: not this one's
        while True:
            conn.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    before = time.monotonic()
    sent = conn.sendmsg([data], _STAMP_SEND)
    if sent < len(data):
        conn.sendall(data[sent:])
        return before
    try:
        _, ancillary, _, _ = conn.recvmsg(0, 256, socket.MSG_ERRQUEUE | socket.MSG_DONTWAIT)
    except OSError:
        return before
    shift = time.monotonic() - time.time()
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == _TIMESTAMPING:
            sec, nsec = struct.unpack("qq", payload[:16])
            return sec + nsec * 1e-9 + shift
    return before


def _recv_stamped(conn: socket.socket) -> tuple[bytes, float, float]:
    """Bytes, the kernel's arrival stamp (unix time) and that stamp on the monotonic clock (the clients' clock:
    the wall clock may be stepped, intervals are measured on this one)."""
    data, ancillary, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(16))
    shift = time.monotonic() - time.time()
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == _TIMESTAMPNS:
            sec, nsec = struct.unpack("qq", payload[:16])
            return data, sec + nsec * 1e-9, sec + nsec * 1e-9 + shift
    return data, time.time(), time.monotonic()


def main() -> int:
    """Serve until SIGTERM, then write the truth as JSON lines (the benchmark's independent server)."""
    args = server_arguments(__doc__)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    threading.stack_size(256 * 1024)  # a thread per connection: thousands of them
    with StampServer(ttft_s=args.ttft_s, tpot_s=args.tpot_s, tokens=args.tokens, protocol=args.protocol) as server:
        print(server.base_url, flush=True)
        stop.wait()
        with server._lock:
            lines = [json.dumps(t) for t in server.truth]
    with open(args.truth, "w") as out:
        out.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
