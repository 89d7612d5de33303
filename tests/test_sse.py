"""The shared SSE decoder against every SSE framing rule, and against random network splits.

Peers fail on exactly these cases (vLLM bench splits on `\\n\\n` only, llmperf
slices fixed offsets), so each rule has an example test and the whole grammar
has a property test: any re-chunking of a valid stream must give the events of
a single feed.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenload.sse import SSEDecoder, SSEEvent

BOM = b"\xef\xbb\xbf"


def decode(*chunks: bytes) -> tuple[list[SSEEvent], bool]:
    """Feed `chunks` in order; the events and close()'s truncation flag."""
    dec = SSEDecoder()
    events = [e for chunk in chunks for e in dec.feed(chunk)]
    return events, dec.close()


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c for c in cuts if 0 < c < len(data)})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)])]


# ------------------------------------------------------------------ property

_FIELD_TEXT = st.text(
    alphabet=st.one_of(st.sampled_from("aZ0 :{}\"[],é中😀\t\x00\ufeff"), st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n")),
    max_size=12,
)
_EOLS = st.sampled_from(["\n", "\r\n", "\r"])


@st.composite
def sse_streams(draw: st.DrawFn) -> tuple[bytes, list[SSEEvent], int]:
    """A valid stream with mixed line ends, comments and ids; its expected events and comment count."""
    lines: list[str] = []
    expected: list[SSEEvent] = []
    comments = 0
    last_id: str | None = None
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.booleans()):
            lines.append(":" + draw(_FIELD_TEXT))
            comments += 1
        name = draw(st.one_of(st.none(), st.text(alphabet="abcxyz_.", min_size=1, max_size=8)))
        if name is not None:
            lines.append(f"event: {name}")
        if draw(st.booleans()):
            last_id = draw(st.text(alphabet="0123456789abc", max_size=4))
            lines.append(f"id: {last_id}")
        data_lines = draw(st.lists(_FIELD_TEXT, min_size=1, max_size=3))
        for value in data_lines:
            no_space = draw(st.booleans()) and not value.startswith(" ")
            lines.append(("data:" if no_space else "data: ") + value)
            if draw(st.booleans()):
                lines.append(": keepalive")
                comments += 1
        lines.append("")  # blank line: dispatch
        expected.append(SSEEvent(name or "message", "\n".join(data_lines), last_id))
    eols = [draw(_EOLS) for _ in lines]
    for i in range(1, len(lines)):
        # A CR followed by the LF of an empty line would read as one CRLF: not the stream we mean.
        if eols[i - 1] == "\r" and lines[i] == "" and eols[i] == "\n":
            eols[i] = "\r\n"
    text = "".join(line + eol for line, eol in zip(lines, eols))
    data = (BOM if draw(st.booleans()) else b"") + text.encode("utf-8")
    return data, expected, comments


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sse_streams(), st.lists(st.integers(0, 400), max_size=40))
def test_any_rechunking_gives_the_events_of_one_feed(stream: tuple[bytes, list[SSEEvent], int], cuts: list[int]) -> None:
    """Network reads split anywhere (inside UTF-8 characters, the BOM, CRLF pairs): the events must not change."""
    data, expected, comments = stream
    whole, truncated = decode(data)
    assert whole == expected
    assert not truncated
    dec = SSEDecoder()
    pieces = [e for chunk in split(data, cuts) for e in dec.feed(chunk)]
    assert pieces == expected
    assert dec.comments == comments
    assert dec.close() is False


@settings(max_examples=100, deadline=None)
@given(sse_streams())
def test_one_byte_per_read(stream: tuple[bytes, list[SSEEvent], int]) -> None:
    """The extreme split: every byte its own read."""
    data, expected, _ = stream
    events, truncated = decode(*(data[i : i + 1] for i in range(len(data))))
    assert events == expected and not truncated


# ------------------------------------------------------------ rules by example


@pytest.mark.parametrize(
    "raw",
    [
        b"data: a\n\ndata: b\n\n",
        b"data: a\r\n\r\ndata: b\r\n\r\n",
        b"data: a\r\rdata: b\r\r",
        b"data: a\r\n\rdata: b\n\r\n",
    ],
    ids=["LF", "CRLF", "CR", "mixed"],
)
def test_line_endings(raw: bytes) -> None:
    events, truncated = decode(raw)
    assert [e.data for e in events] == ["a", "b"] and not truncated


def test_blank_line_dispatches_and_nothing_before_it() -> None:
    """An event is only complete at its blank line: feeding its data line alone yields nothing."""
    dec = SSEDecoder()
    assert dec.feed(b"event: x\ndata: 1\n") == []
    assert dec.feed(b"\n") == [SSEEvent("x", "1")]


def test_multiline_data_joined_with_newline() -> None:
    events, _ = decode(b"data: {\"a\":\ndata:  1}\n\n")
    assert events == [SSEEvent("message", '{"a":\n 1}')]


@pytest.mark.parametrize(
    ("raw", "data"),
    [(b"data:x\n\n", "x"), (b"data: x\n\n", "x"), (b"data:  x\n\n", " x"), (b"data\n\n", ""), (b"data:\n\n", "")],
    ids=["no-space", "one-space", "two-spaces", "no-colon", "empty"],
)
def test_only_one_space_after_the_colon_is_stripped(raw: bytes, data: str) -> None:
    events, _ = decode(raw)
    assert events == [SSEEvent("message", data)]


def test_comments_are_not_events_and_do_not_break_an_event() -> None:
    dec = SSEDecoder()
    events = dec.feed(b": ping\n\n:\ndata: a\n: keepalive\ndata: b\n\n")
    assert events == [SSEEvent("message", "a\nb")]
    assert dec.comments == 3


def test_event_type_resets_after_dispatch_and_unknown_fields_are_ignored() -> None:
    events, _ = decode(b"event: ping\nretry: 10\nfoo: bar\ndata: {}\n\ndata: next\n\n")
    assert events == [SSEEvent("ping", "{}"), SSEEvent("message", "next")]


def test_id_is_kept_until_changed() -> None:
    events, _ = decode(b"id: 7\ndata: a\n\ndata: b\n\nid: 8\ndata: c\n\n")
    assert [e.id for e in events] == ["7", "7", "8"]


def test_done_sentinel_without_space() -> None:
    events, _ = decode(b"data:[DONE]\n\n")
    assert events == [SSEEvent("message", "[DONE]")]


@pytest.mark.parametrize(
    "chunks",
    [
        [BOM + b"data: x\n\n"],
        [b"\xef", b"\xbb", b"\xbfdata: x\n\n"],
        [b"\xef\xbb", b"\xbf", b"d", b"ata: x\n\n"],
        [BOM, b"data: x\n\n"],
    ],
    ids=["whole", "byte-by-byte", "split-2-1", "alone"],
)
def test_leading_bom_is_stripped_even_split_across_reads(chunks: list[bytes]) -> None:
    events, _ = decode(*chunks)
    assert events == [SSEEvent("message", "x")]


def test_only_the_leading_bom_is_stripped() -> None:
    """A second BOM belongs to the first field name, which then is no known field."""
    events, _ = decode(BOM + BOM + b"data: x\n\ndata: y\n\n")
    assert events == [SSEEvent("message", "y")]


def test_bom_prefix_that_never_becomes_a_bom_is_not_held_back() -> None:
    """Bytes held while the BOM question is open are released once it is settled."""
    events, _ = decode(b"\xef", b"\ndata: z\n\n")
    assert events == [SSEEvent("message", "z")]


@pytest.mark.parametrize(
    ("chunks", "events_after_each"),
    [
        ([b"data: a\r", b"\n", b"\r\n"], [0, 0, 1]),
        ([b"data: a\r", b"\r"], [0, 1]),
        ([b"data: a\r\r"], [1]),
        ([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"], [0, 0, 1, 0]),
    ],
    ids=["crlf-split", "cr-cr", "cr-only-not-delayed", "crlf-split-twice"],
)
def test_cr_lf_split_between_reads(chunks: list[bytes], events_after_each: list[int]) -> None:
    """A CR at the end of a read ends the line at once; a following LF is not a second (blank) line."""
    dec = SSEDecoder()
    counts = [len(dec.feed(c)) for c in chunks]
    assert counts == events_after_each
    assert dec.close() is False


def test_utf8_split_inside_a_character() -> None:
    raw = "data: héllo 😀 中\n\n".encode()
    cut = raw.index("😀".encode()) + 2
    events, _ = decode(raw[:cut], raw[cut:])
    assert events == [SSEEvent("message", "héllo 😀 中")]


def test_invalid_utf8_is_replaced_not_fatal() -> None:
    events, _ = decode(b"data: a\xffb\n\n")
    assert events == [SSEEvent("message", "a\ufffdb")]


@pytest.mark.parametrize(
    "raw",
    [b"data: x", b"data: x\n", b"event: message_stop\ndata: {}\r\n"],
    ids=["no-eol", "no-blank-line", "crlf-no-blank-line"],
)
def test_final_event_without_blank_line_is_not_dispatched_and_close_reports_it(raw: bytes) -> None:
    events, truncated = decode(raw)
    assert events == []
    assert truncated is True


def test_close_after_complete_stream_reports_nothing_pending() -> None:
    events, truncated = decode(b"data: x\n\n: trailing comment\n")
    assert len(events) == 1 and truncated is False
