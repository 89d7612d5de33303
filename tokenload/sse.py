"""One incremental server-sent-events decoder shared by every protocol adapter.

Network reads split a stream anywhere: inside a line, between `\\r` and `\\n`,
inside a UTF-8 character. The decoder works on bytes (line ends are ASCII, so
they never occur inside a multi-byte character) and decodes only whole lines.
It follows the WHATWG event-stream rules that peer tools get wrong: CRLF, LF and
CR line ends mixed in one stream; a blank line dispatches; several `data:` lines
join with `\\n`; one space after the colon is stripped; `:` lines are comments;
a leading BOM is dropped; a final event without its blank line is not dispatched.
A trailing `\\r` is taken as a line end at once (no waiting for a possible `\\n`),
so CR-only streams are not delayed by one read.
"""

from __future__ import annotations

from typing import NamedTuple

_BOM = b"\xef\xbb\xbf"


class SSEEvent(NamedTuple):
    """One dispatched event: its type (`message` when none was named), data and id.

    A named tuple rather than a dataclass: one is built per token on the load
    generator's hot path, and tuple construction is the cheapest there is.
    """

    event: str
    data: str
    id: str | None = None


class SSEDecoder:
    """Feed it bytes as they arrive; it returns the events completed by each read."""

    __slots__ = ("_partial", "_skip_lf", "_head", "_data", "_event", "_id", "comments")

    def __init__(self) -> None:
        self._partial = b""
        self._skip_lf = False
        self._head: bytes | None = b""  # bytes held until the BOM question is settled
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self.comments = 0

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        if self._head is not None or self._skip_lf:
            chunk = self._settle(chunk)
        buf = self._partial + chunk if self._partial else chunk
        if not buf:
            return []
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        # Whole lines end on a character boundary, so one decode serves them all.
        if buf[-1] == 10:  # the usual read: whole events, nothing held back, no slice to copy
            self._partial = b""
            lines = buf.decode("utf-8", "replace").split("\n")
            lines.pop()
        else:
            cut = buf.rfind(b"\n")
            if cut < 0:
                self._partial = buf
                return []
            self._partial = buf[cut + 1 :]
            lines = buf[:cut].decode("utf-8", "replace").split("\n")
        # One pass per line, most frequent first; inlined: it runs once per token under load.
        events: list[SSEEvent] = []
        data = self._data
        for line in lines:
            if line.startswith("data:"):
                data.append(line[6:] if line[5:6] == " " else line[5:])
            elif not line:
                if data:
                    events.append(SSEEvent(self._event or "message", "\n".join(data), self._id))
                    data = self._data = []
                self._event = ""
            elif line.startswith("event:"):
                self._event = line[7:] if line[6:7] == " " else line[6:]
            elif line[0] == ":":
                self.comments += 1
            else:
                name, sep, value = line.partition(":")
                if sep and value[:1] == " ":
                    value = value[1:]
                if name == "data":
                    data.append(value)
                elif name == "id" and "\0" not in value:
                    self._id = value
        return events

    @property
    def idle(self) -> bool:
        """Between events: no partial line, field or pending `\n`; what the next byte starts is an event."""
        return not (self._partial or self._data or self._event or self._skip_lf) and self._head is None

    def _settle(self, chunk: bytes) -> bytes:
        """The stream's first bytes (a leading BOM dropped) and the `\n` of a CRLF split after `\r`."""
        if self._head is not None:
            chunk = self._head + chunk
            if len(chunk) < len(_BOM) and _BOM.startswith(chunk):
                self._head = chunk
                return b""
            self._head = None
            if chunk.startswith(_BOM):
                chunk = chunk[len(_BOM) :]
        if self._skip_lf:
            self._skip_lf = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        return chunk

    def close(self) -> bool:
        """End of stream. True when an event was left unterminated (a truncated stream)."""
        pending = bool(self._partial.strip()) or bool(self._data)
        self._partial = b""
        self._data = []
        self._event = ""
        return pending
