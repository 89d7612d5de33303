"""Fault specs: one grammar for prompt markers and for the profile's `[faults]` rates.

A spec is `KIND` or `KIND key=value ...`. In a prompt it is wrapped as
`[[fault:KIND key=value ...]]`; several markers combine (for example a framing
variant plus a disconnect). In a profile, `[faults]` maps the same spec text to
a probability per request. `after=N` counts output tokens already written; when
omitted it is half the planned output. See `KINDS` for every kind and default.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from random import Random

# kind -> (parameter defaults, what it does). `None` means "derived per request".
KINDS: dict[str, tuple[dict[str, float | str | None], str]] = {
    "disconnect": ({"after": None}, "close the connection (FIN) after N tokens, mid-stream"),
    "reset": ({"after": None}, "abort the connection with RST after N tokens"),
    "stall": ({"after": None, "seconds": 5.0}, "stop sending for S seconds after N tokens, then continue"),
    "error_event": ({"after": None}, "in-stream error after N tokens (Anthropic event: error overloaded_error, OpenAI data: {error}, Responses response.failed), then end"),
    "malformed": ({"after": None}, "one event with truncated JSON before token N, then continue"),
    "no_final_chunk": ({}, "end the chunked body without its terminating chunk, then FIN"),
    "status": ({"code": 500.0, "body": "json"}, "HTTP error CODE instead of a stream; body=json (the protocol's error body) or body=empty"),
    "html": ({"code": 200.0}, "an HTML page with status CODE instead of a stream (a wrong base URL)"),
    "json_body": ({}, "a complete non-stream JSON body although a stream was asked"),
    "slow_headers": ({"seconds": 3.0}, "send the response headers only after S seconds"),
    "silence": ({"seconds": 30.0}, "send headers, then nothing for S seconds, then close"),
    "no_usage": ({}, "omit usage (Anthropic message_delta usage, OpenAI usage chunk, Responses usage)"),
    "crlf": ({}, "CRLF line ends"),
    "cr": ({}, "CR-only line ends"),
    "nospace": ({}, "no space after the colon (`data:{...}`, `data:[DONE]`)"),
    "split": ({"bytes": 1.0}, "write the body in pieces of N bytes, one write (and HTTP chunk) each"),
    "bom": ({}, "a UTF-8 byte order mark before the first event"),
    "multiline": ({}, "every JSON payload split over two `data:` lines"),
    "comments": ({}, "a `: keepalive` comment line before every event"),
    "unicode": ({}, "non-ASCII output words (multi-byte UTF-8, split across writes with `split`)"),
    "pad": ({"bytes": 262144.0}, "the first event's JSON padded with N trailing spaces (one huge event)"),
}
# Faults that replace or end the normal stream; at most one per request.
ACTIONS = ("disconnect", "reset", "stall", "error_event", "status", "html", "json_body", "silence")

_MARKER_RE = re.compile(r"\[\[fault:([^\]]*)\]\]")


def parse_spec(spec: str) -> tuple[str, dict[str, float | str | None]]:
    """`"stall after=3 seconds=1"` -> ("stall", {"after": 3.0, "seconds": 1.0}); ValueError if invalid."""
    parts = spec.split()
    if not parts:
        raise ValueError("empty fault spec")
    kind, args = parts[0], parts[1:]
    if kind not in KINDS:
        raise ValueError(f"unknown fault {kind!r} (known: {', '.join(KINDS)})")
    params = dict(KINDS[kind][0])
    for arg in args:
        key, eq, raw = arg.partition("=")
        if not eq or key not in params:
            raise ValueError(f"fault {kind}: unknown argument {arg!r} (takes: {', '.join(params) or 'none'})")
        if key == "body":
            if raw not in ("json", "empty"):
                raise ValueError(f"fault {kind}: body must be json or empty, got {raw!r}")
            params[key] = raw
        else:
            try:
                params[key] = float(raw)
            except ValueError:
                raise ValueError(f"fault {kind}: {key} must be a number, got {raw!r}") from None
    return kind, params


def markers_in(texts: Iterable[str]) -> list[str]:
    """Every `[[fault:...]]` marker body found in the prompt texts, in order."""
    return [m.group(1).strip() for text in texts for m in _MARKER_RE.finditer(text)]


@dataclass
class FaultPlan:
    """The faults one request will meet, resolved against its planned output length."""

    specs: dict[str, dict[str, float | str | None]] = field(default_factory=dict)

    @classmethod
    def build(cls, marker_specs: list[str], rates: dict[str, float], rng: Random, n_out: int) -> FaultPlan:
        """Markers first, then each profile rate drawn once; a second action fault is ignored."""
        chosen = list(marker_specs)
        chosen += [spec for spec, rate in rates.items() if rate > 0 and rng.random() < rate]
        plan = cls()
        for spec in chosen:
            kind, params = parse_spec(spec)
            if kind in ACTIONS and plan.action is not None:
                continue
            if "after" in params and params["after"] is None:
                params["after"] = float(n_out // 2)
            plan.specs[kind] = params
        return plan

    @property
    def action(self) -> str | None:
        return next((k for k in self.specs if k in ACTIONS), None)

    def has(self, kind: str) -> bool:
        return kind in self.specs

    def num(self, kind: str, key: str) -> float:
        value = self.specs[kind][key]
        assert isinstance(value, float)
        return value

    def after(self, kind: str) -> int:
        """Token index before which `kind` strikes, or -1 when the request does not have it."""
        return int(self.num(kind, "after")) if kind in self.specs else -1

    def describe(self) -> str | None:
        """What the truth file records: `"disconnect after=5; crlf"`, or None."""
        if not self.specs:
            return None
        parts = []
        for kind, params in self.specs.items():
            args = " ".join(f"{k}={_fmt(v)}" for k, v in params.items())
            parts.append(f"{kind} {args}".strip())
        return "; ".join(parts)


def _fmt(value: float | str | None) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def describe_kinds() -> str:
    """The marker reference for --help."""
    lines = []
    for kind, (params, what) in KINDS.items():
        args = " ".join(f"{k}={'N/2' if v is None else _fmt(v)}" for k, v in params.items())
        lines.append(f"  [[fault:{kind}{' ' + args if args else ''}]]\n      {what}")
    return "\n".join(lines)
