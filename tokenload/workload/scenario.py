"""Scenario files: what load to send, validated before a single request goes out.

A scenario is a TOML file (`scenarios/*.toml`) with the sections `[channel]`,
`[prompt]`, `[output]`, `[load]` and `[stop]`. Every value is checked here and a
mistake becomes one `ConfigError` line that names the file and the field
(`demo.toml: [load] users: expected ...`), because a typo found after ten
minutes of paid load is a wasted ten minutes.

The resolved scenario (`Scenario.to_dict()`) has the same shape as the TOML, with
every shorthand expanded (a number becomes `{dist = "fixed", value = N}`), so it
round-trips: `tokenload run` writes it to the run directory, the Locust
processes read it back through the same validation, and `manifest.json` shows
exactly what ran.

Each key is declared once, as a field of its section's dataclass: the field's
default is the key's default, and its `Key` (`_key(...)`) says how the value is
checked and what its line in the schema says. `SCHEMA_HELP`, printed by
`tokenload run --help` and copied into docs/scenarios.md, is generated from them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

from tokenload.compat import tomllib
from tokenload.errors import ConfigError
from tokenload.protocolspec import PROTOCOLS
from tokenload.slo import DEFAULT as DEFAULT_SLO
from tokenload.slo import METRICS as SLO_METRICS
from tokenload.slo import Slo
from tokenload.thresholds import INCONCLUSIVE_CHOICES
from tokenload.thresholds import parse as parse_threshold
from tokenload.workload.datasets import load_dataset
from tokenload.workload.traces import TIME_UNITS, load_trace, trace_span_s

DISTRIBUTIONS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (required parameters, optional parameters)
    "fixed": (("value",), ()),
    "uniform": (("min", "max"), ()),
    "normal": (("mean", "std"), ("min", "max")),
    "lognormal": (("median", "sigma"), ("min", "max")),
    "sweep": (("values",), ()),
}
LOAD_KINDS = ("steps", "constant", "poisson", "trace", "search")
SEARCH_OVER = ("users", "rate")
OPEN_LOOP_KINDS = ("poisson", "trace")
DATASET_ORDERS = ("sequential", "shuffle")
_ANY_KIND = ("max_rps", "max_tokens_per_min", "retry", "step_warmup_s", "warmup_s", "warmup_requests")  # [load] keys every kind takes
ARRIVALS = ("poisson", "constant", "gamma")
RAMPS = ("none", "linear", "exponential")
_COMMENT_AT = 30  # the schema's comments start in this column (after a 4-space indent)
DEFAULT_PROMPT_TOKENS = 256  # [prompt] tokens when neither tokens, a dataset nor a [session] is given


@dataclass(frozen=True)
class Key:
    """How one scenario key is checked and shown in the schema (its default is its field's).

    `kind` number | integer | flag | text are checked by `_Ctx.read`; `custom` ones by their section's
    parse (a distribution, a list, a default that depends on another key). `example` is the schema's
    value where the default says nothing (no default, or one computed at parse); `toml` the key's name
    where it differs from the field's; `inline` a dataclass whose keys sit in this section's table.
    """

    help: str = ""
    kind: str = "custom"
    minimum: float | None = None
    above: float | None = None
    choices: tuple[str, ...] | None = None
    example: str | None = None
    toml: str | None = None
    inline: type | None = None


def _key(default: Any = None, help: str = "", *, factory: Any = None, **how: Any) -> Any:
    """A scenario key: a dataclass field with its default and its `Key`."""
    meta = {"key": Key(help, **how)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _keys(cls: type, inline: bool = True) -> Iterator[tuple[str, dataclasses.Field[Any], Key]]:
    """(TOML name, field, Key) of every key `cls` declares (`inline`: an inline dataclass's too)."""
    for f in dataclasses.fields(cls):
        key = f.metadata.get("key")
        if key is None:
            continue
        if key.inline is not None:
            if inline:
                yield from _keys(key.inline)
        else:
            yield key.toml or f.name, f, key


def key_names(cls: type) -> tuple[str, ...]:
    """The TOML keys of a section."""
    return tuple(name for name, _, _ in _keys(cls))


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def _toml(value: Any) -> str:
    """A default as the schema shows it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return f"{value:g}"
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, Distribution):
        params = value.params
        return _toml(params["value"]) if value.dist == "fixed" else _toml(params.get("values"))
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no schema form for {value!r}")


def _commented(text: str, help: str) -> list[str]:
    """`text` with its comment from column `_COMMENT_AT`, continuation lines below it."""
    first, *more = help.split("\n") if help else [""]
    lines = [f"{text:<{_COMMENT_AT - 2}}  # {first}".rstrip() if first else text]
    return lines + [" " * _COMMENT_AT + f"# {line}" for line in more]


def schema_lines(cls: type) -> list[str]:
    """One section's lines of the schema: its `[table]` line (none for the top level), then a line per key."""
    table: str | None = getattr(cls, "TABLE", None)
    lines = _commented(f"[{table}]", getattr(cls, "HELP", "")) if table else []
    for name, f, key in _keys(cls):
        lines += _commented(f"{name} = {key.example if key.example is not None else _toml(_default(f))}", key.help)
    return lines


class _Ctx:
    """Where a value came from, for error messages: `demo.toml: [load] users`."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where}: {problem}" if self.source else f"{where}: {problem}")

    def table(self, data: Any, where: str, allowed: tuple[str, ...]) -> dict[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, dict):
            raise self.fail(where, f"expected a table, got {_show(data)}")
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise self.fail(f"{where} {unknown[0]}", f"unknown key; allowed keys: {', '.join(allowed)}")
        return data

    def number(self, data: dict[str, Any], key: str, where: str, default: float | None = None, *,
               integer: bool = False, minimum: float | None = None, above: float | None = None) -> Any:
        value = data.get(key, default)
        label = f"{where} {key}".strip()
        if value is None:
            raise self.fail(label, "missing; this field is required")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
            raise self.fail(label, f"expected {'an integer' if integer else 'a number'}, got {_show(value)}")
        if not math.isfinite(value):
            raise self.fail(label, f"expected a finite number, got {value}")
        if minimum is not None and value < minimum:
            raise self.fail(label, f"must be at least {minimum:g}, got {value}")
        if above is not None and value <= above:
            raise self.fail(label, f"must be greater than {above:g}, got {value}")
        return value

    def flag(self, data: dict[str, Any], key: str, where: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(f"{where} {key}", f"expected true or false, got {_show(value)}")
        return value

    def text(self, data: dict[str, Any], key: str, where: str, default: str | None = None,
             choices: tuple[str, ...] | None = None) -> str | None:
        value = data.get(key, default)
        if value is None:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{where} {key}", f"expected a non-empty string, got {_show(value)}")
        if choices and value not in choices:
            raise self.fail(f"{where} {key}", f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def read(self, cls: type, data: dict[str, Any], where: str) -> dict[str, Any]:
        """Field name -> value of every key of `cls` its `Key` checks (the others are the section's own):
        the value given, else the field's default (a default of None: absent stays None)."""
        out: dict[str, Any] = {}
        for name, f, key in _keys(cls, inline=False):
            default = _default(f)
            if key.kind == "custom" or (default is None and name not in data):
                continue
            if key.kind == "flag":
                out[f.name] = self.flag(data, name, where, default)
            elif key.kind == "text":
                out[f.name] = self.text(data, name, where, default, choices=key.choices)
            else:
                out[f.name] = self.number(data, name, where, default, integer=key.kind == "integer",
                                          minimum=key.minimum, above=key.above)
        return out


def _show(value: Any) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Distribution:
    """A distribution of positive integers (prompt tokens, max_tokens); drawn in `prompts.py`."""

    dist: str
    params: dict[str, Any]

    @classmethod
    def parse(cls, value: Any, where: str, ctx: _Ctx, *, floor: int = 1) -> Distribution:
        """Accept `N`, `[a, b, ...]` (a sweep) or `{dist = ..., ...}`; `floor` is the smallest allowed value."""
        if isinstance(value, list):
            value = {"dist": "sweep", "values": value}
        elif not isinstance(value, dict):
            value = {"dist": "fixed", "value": value}
        name = ctx.text(value, "dist", where, choices=tuple(DISTRIBUTIONS))
        if name is None:
            raise ctx.fail(f"{where} dist", f"missing; one of {', '.join(DISTRIBUTIONS)}")
        required, optional = DISTRIBUTIONS[name]
        ctx.table(value, where, ("dist", *required, *optional))
        params: dict[str, Any] = {}
        if name == "sweep":
            values = value.get("values")
            if not isinstance(values, list) or not values:
                raise ctx.fail(f"{where} values", f"expected a non-empty list of integers, got {_show(values)}")
            for v in values:
                if isinstance(v, bool) or not isinstance(v, int) or v < floor:
                    raise ctx.fail(f"{where} values", f"every value must be an integer >= {floor}, got {_show(v)}")
            params["values"] = list(values)
        elif name == "fixed":
            params["value"] = ctx.number(value, "value", where, integer=True, minimum=floor)
        elif name == "uniform":
            params["min"] = ctx.number(value, "min", where, integer=True, minimum=floor)
            params["max"] = ctx.number(value, "max", where, integer=True, minimum=params["min"])
        else:
            centre, spread = required
            params[centre] = ctx.number(value, centre, where, above=0)
            params[spread] = ctx.number(value, spread, where, minimum=0)
            params["min"] = ctx.number(value, "min", where, floor, integer=True, minimum=floor)
            if "max" in value:
                params["max"] = ctx.number(value, "max", where, integer=True, minimum=params["min"])
        return cls(name, params)

    def to_dict(self) -> dict[str, Any]:
        return {"dist": self.dist, **self.params}

    @property
    def upper(self) -> int | None:
        """The largest value it can produce, when bounded."""
        p = self.params
        if self.dist == "sweep":
            return max(p["values"])
        return p.get("value", p.get("max"))


@dataclass(frozen=True)
class ChannelSection:
    TABLE: ClassVar[str] = "channel"
    HELP: ClassVar[str] = "defaults: flags, environment, settings.json win"

    protocol: str | None = _key(None, " | ".join(PROTOCOLS), kind="text", choices=PROTOCOLS,
                                example='"anthropic"')
    base_url: str | None = _key(None, kind="text", example='"http://..."')
    models: tuple[str, ...] = _key((), 'or model = "sim-7b"; requests pick uniformly (`run --model` repeated '
                                   "replaces it)", example='["sim-7b"]')
    model_sizes: dict[str, float] = _key(help="billions of parameters, for ids that do not name their size\n"
                                         "(`sim-30b`, `70b`, `270m`, `8x7b` are read from the id)", factory=dict,
                                         example='{ "my-model" = 30 }')
    first_token_timeout_s: float = _key(120.0, kind="number", above=0)
    idle_timeout_s: float = _key(60.0, kind="number", above=0)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> ChannelSection:
        w = "[channel]"
        d = ctx.table(data, w, (*key_names(cls), "model"))
        if "model" in d and "models" in d:
            raise ctx.fail(f"{w} model", "give either model or models, not both")
        models: Any = [d["model"]] if "model" in d else d.get("models", [])
        if not isinstance(models, list) or not all(isinstance(m, str) and m.strip() for m in models):
            raise ctx.fail(f"{w} models", f"expected a list of model ids, got {_show(models)}")
        sizes = d.get("model_sizes", {})
        if not isinstance(sizes, dict):
            raise ctx.fail(f"{w} model_sizes", f"expected a table of model id = billions of parameters, got {_show(sizes)}")
        return cls(**ctx.read(cls, d, w), models=tuple(models),
                   model_sizes={str(m): float(ctx.number(sizes, m, f"{w} model_sizes", above=0)) for m in sizes})


@dataclass(frozen=True)
class PromptSection:
    TABLE: ClassVar[str] = "prompt"

    tokens: Distribution | None = _key(help="fixed; [128, 512] sweeps round-robin; or a table:\n"
                                       '{dist="uniform", min, max} | {dist="normal", mean, std, min?, max?}\n'
                                       '| {dist="lognormal", median, sigma, min?, max?}',
                                       example=str(DEFAULT_PROMPT_TOKENS))
    dataset: str | None = _key(None, "instead of tokens: one request per row, format told by the row:\n"
                               'JSONL {"prompt"} | {"messages", "system"?} (OpenAI chat, Anthropic)\n'
                               '| ShareGPT {"conversations": [{"from", "value"}]} (JSON array or JSONL);\n'
                               "a row's max_tokens / output_tokens (or trailing reply) sets its output",
                               kind="text", example='"prompts.jsonl"')
    order: str = _key("sequential", 'dataset rows in file order, or "shuffle" (seeded)', kind="text",
                      choices=DATASET_ORDERS)
    shared_prefix_tokens: int = _key(0, "a prefix common to every request (prompt-cache hits); 0 = all unique",
                                     kind="integer", minimum=0)
    calibrate: bool = _key(True, "scale synthetic prompts by the server's reported input tokens", kind="flag")

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx, base_dir: Path, session: bool = False) -> PromptSection:
        """With a [session], messages come from there: only `calibrate` applies."""
        w = "[prompt]"
        d = ctx.table(data, w, key_names(cls))
        read = ctx.read(cls, d, w)
        if read["order"] != "sequential" and "dataset" not in d:
            raise ctx.fail(f"{w} order", "only applies to a dataset")
        if session:
            clash = [k for k in ("tokens", "dataset") if k in d] + (["shared_prefix_tokens"] if d.get("shared_prefix_tokens") else [])
            if clash:
                raise ctx.fail(f"{w} {clash[0]}", "a [session] scenario draws its messages from [session] "
                               "user_tokens and system_tokens; remove this key")
            return cls(calibrate=read["calibrate"])
        if "tokens" in d and "dataset" in d:
            raise ctx.fail(f"{w} dataset", "give either tokens or dataset, not both")
        shared = read["shared_prefix_tokens"]
        dataset = read.get("dataset")
        tokens = None
        if dataset is not None:
            path = (base_dir / dataset).resolve()
            if not path.is_file() and packaged_file(dataset).is_file():  # a dataset shipped with tokenload
                path = packaged_file(dataset)
            if not path.is_file():
                raise ctx.fail(f"{w} dataset", f"file {path} does not exist")
            dataset = str(path)
            load_dataset(dataset)  # every row checked now, before any load starts
        else:
            tokens = Distribution.parse(d.get("tokens", DEFAULT_PROMPT_TOKENS), f"{w} tokens", ctx, floor=max(1, shared))
        return cls(**{**read, "tokens": tokens, "dataset": dataset})


@dataclass(frozen=True)
class SessionSection:
    """Coding-assistant traffic: each user holds a conversation whose context grows turn by turn."""

    TABLE: ClassVar[str] = "session"
    HELP: ClassVar[str] = "multi-turn conversations instead of independent prompts"

    turns: Distribution = _key(help="turns per conversation (same forms as prompt.tokens)",
                               factory=lambda: Distribution("fixed", {"value": 3}))
    user_tokens: Distribution = _key(help="length of each new user message (same forms)",
                                     factory=lambda: Distribution("fixed", {"value": 200}))
    system_tokens: int = _key(0, "system prompt shared by every user and session; 0 = none", kind="integer",
                              minimum=0)
    think_time_s: float = _key(0.0, "pause between a conversation's turns", kind="number", minimum=0)
    cache_control: bool = _key(False, "Anthropic: prompt-cache breakpoints on the system prompt and the newest "
                               "message", kind="flag")

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> SessionSection:
        w = "[session]"
        d = ctx.table(data, w, key_names(cls))
        lengths: dict[str, Any] = {k: Distribution.parse(d[k], f"{w} {k}", ctx) for k in ("turns", "user_tokens")
                                   if k in d}
        return cls(**ctx.read(cls, d, w), **lengths)


@dataclass(frozen=True)
class OutputSection:
    TABLE: ClassVar[str] = "output"

    max_tokens: Distribution = _key(help="same forms as prompt.tokens",
                                    factory=lambda: Distribution("fixed", {"value": 128}))
    ignore_eos: bool = _key(False, 'sent as "ignore_eos": true (vLLM/SGLang extension)', kind="flag")
    min_tokens: int = _key(0, 'sent as "min_tokens" when > 0', kind="integer", minimum=0)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> OutputSection:
        w = "[output]"
        d = ctx.table(data, w, key_names(cls))
        read = ctx.read(cls, d, w)
        max_tokens = Distribution.parse(d["max_tokens"], f"{w} max_tokens", ctx) if "max_tokens" in d else cls().max_tokens
        min_tokens = read["min_tokens"]
        lowest = max_tokens.params.get("value", max_tokens.params.get("min"))
        if max_tokens.dist == "sweep":
            lowest = min(max_tokens.params["values"])
        if min_tokens and lowest is not None and min_tokens > lowest:
            raise ctx.fail(f"{w} min_tokens", f"{min_tokens} is above the smallest max_tokens ({lowest})")
        return cls(**read, max_tokens=max_tokens)

    def extra_body(self) -> dict[str, Any]:
        """Body fields beyond the protocol's own (vLLM/SGLang extensions)."""
        extra: dict[str, Any] = {}
        if self.ignore_eos:
            extra["ignore_eos"] = True
        if self.min_tokens:
            extra["min_tokens"] = self.min_tokens
        return extra


DESIGN_KINDS = ("factorial", "latin")


@dataclass(frozen=True)
class DesignSection:
    """`[design]`: the factors crossed instead of swept in lockstep (`tokenload.workload.design` draws the cells)."""

    TABLE: ClassVar[str] = "design"
    HELP: ClassVar[str] = ("vary prompt length, output length and model independently (sweeps otherwise\n"
                           "advance in lockstep): the levels are [prompt] tokens, [output] max_tokens\n"
                           "(lists or one value) and the channel's models; every [load] step runs it all")

    kind: str = _key("factorial", "factorial: every combination; latin: a Latin hypercube of `points`\n"
                     "combinations (each level of each factor equally often)", kind="text", choices=DESIGN_KINDS)
    points: int = _key(0, "latin: combinations per block; 0 = the largest number of levels\n"
                       "each user sends a block's cells in its own seeded random order, then the next",
                       kind="integer", minimum=0)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> DesignSection:
        w = "[design]"
        d = ctx.table(data, w, key_names(cls))
        read = ctx.read(cls, d, w)
        if d.get("points") and read["kind"] != "latin":
            raise ctx.fail(f"{w} points", 'only applies to kind = "latin"')
        return cls(**read)

    @staticmethod
    def check(ctx: _Ctx, prompt: PromptSection, output: OutputSection, models: tuple[str, ...]) -> None:
        """A design's factors are levels: lists or single values of [prompt] tokens and [output] max_tokens."""
        if prompt.tokens is None:
            raise ctx.fail("[design]", "crosses [prompt] tokens levels; a dataset or a [session] brings its own "
                           "lengths: remove [design] or give [prompt] tokens")
        for where, dist in (("[prompt] tokens", prompt.tokens), ("[output] max_tokens", output.max_tokens)):
            if dist.dist not in ("sweep", "fixed"):
                raise ctx.fail(where, f"a [design] crosses levels: give a list of values (or one), not dist = "
                               f"{dist.dist!r}")
        varied = sum(len(d.params.get("values", [0])) > 1 for d in (prompt.tokens, output.max_tokens))
        if varied + (len(models) > 1) == 0:
            raise ctx.fail("[design]", "nothing to cross: give [prompt] tokens or [output] max_tokens as a list of "
                           "levels, or several [channel] models")


RATE_MAX, RATE_RESOLUTION = 100.0, 0.1  # a search over rate: the highest rate probed and the boundary's closeness
RATE_POOL = 256  # a search over rate: its users (`max_users`)
# Probes beyond the plan a search may need: a second trial that disagrees sends it one level down, and again.
PROBE_SLACK = 2
# Over users, a served-concurrency hint that missed (`Search._hinted`): two levels, each with its second trial.
HINT_SLACK = 4


def default_max_probes(over: str, low: float, high: float, resolution: float) -> int:
    """The probes a search of [low, high] to `resolution` needs: the doublings up to `high`, the
    bisection of the widest bracket they can leave twice over (room for second trials and levels at the
    edge: `Search.rephased`, `evidence.at_edge`), `PROBE_SLACK`, and over users
    `HINT_SLACK` (1..256 users to 1 user: 9 + 2 x 7 + 2 + 4 = 29)."""
    doublings = math.ceil(math.log2(high / low) - 1e-9) + 1 if high > low else 1
    if over == "users":  # the last bracket is [high / 2, high] at widest
        bisections = math.ceil(math.log2(max(1.0, high / 2 / max(1.0, resolution))) - 1e-9)
    else:  # a rate bracket [lo, 2 lo] cut geometrically until hi <= lo x (1 + resolution)
        bisections = math.ceil(math.log2(math.log(2) / math.log1p(resolution)) - 1e-9)
    return doublings + max(1, 2 * bisections) + PROBE_SLACK + (HINT_SLACK if over == "users" else 0)


@dataclass(frozen=True)
class SearchSpec:
    """`[load] kind = "search"`: where to look for the highest level that meets the SLO, and how hard."""

    # The defaults of `min`, `max` and `resolution` are the users' (a search over rate: RATE_MAX, RATE_RESOLUTION).
    over: str = _key("users", "search: users (closed loop) or rate (open loop, requests/s; max_users pool)",
                     kind="text", choices=SEARCH_OVER)
    min_level: float = _key(1.0, "search: the lowest level probed (users or requests/s)", toml="min")
    max_level: float = _key(256.0, "search: the highest level probed", toml="max")
    resolution: float = _key(1.0, "search: stop when the boundary is this close (users: 1; rate: 0.1 = 10%)")
    max_probe_s: float = _key(60.0, 'search: a probe undecided after this long says "undecided"', kind="number",
                              above=0)
    probe_warmup_s: float = _key(2.0, "search: requests sent in each probe's first S seconds are warm-up (at a\n"
                                 "step up, only those sent before the level is whole: each new user's first;\n"
                                 "after a step down, users wait until the higher level's backlog is below it)",
                                 kind="number", minimum=0)
    confirm: bool = _key(True, "search: hold the last passing level again; it must pass twice (at 95%)", kind="flag")
    max_probes: int = _key(29, "search: at most this many probes (default: what the range needs, see docs)")

    @classmethod
    def parse(cls, d: dict[str, Any], ctx: _Ctx) -> SearchSpec:
        w = "[load]"
        read = ctx.read(cls, d, w)
        over = read["over"]
        users = over == "users"
        low = ctx.number(d, "min", w, int(cls.min_level) if users else cls.min_level, integer=users, above=0)
        high = ctx.number(d, "max", w, int(cls.max_level) if users else RATE_MAX, integer=users, above=0)
        if high < low:
            raise ctx.fail(f"{w} max", f"must be at least min ({low:g}), got {high:g}")
        resolution = ctx.number(d, "resolution", w, int(cls.resolution) if users else RATE_RESOLUTION,
                                integer=users, above=0)
        if read["probe_warmup_s"] >= read["max_probe_s"]:
            raise ctx.fail(f"{w} probe_warmup_s", f"must be shorter than max_probe_s ({read['max_probe_s']:g}), "
                           f"got {read['probe_warmup_s']:g}")
        return cls(**read, min_level=float(low), max_level=float(high), resolution=float(resolution),
                   max_probes=ctx.number(d, "max_probes", w, default_max_probes(over, low, high, resolution),
                                         integer=True, minimum=1))

    def to_dict(self) -> dict[str, Any]:
        users = self.over == "users"
        level = (lambda v: int(v)) if users else float
        return {"over": self.over, "min": level(self.min_level), "max": level(self.max_level),
                "resolution": level(self.resolution), "max_probe_s": self.max_probe_s,
                "probe_warmup_s": self.probe_warmup_s, "confirm": self.confirm, "max_probes": self.max_probes}


@dataclass(frozen=True)
class LoadSection:
    TABLE: ClassVar[str] = "load"

    kind: str = _key("steps", " | ".join(LOAD_KINDS), kind="text", choices=LOAD_KINDS)
    warmup_requests: int = _key(0, 'any kind: each load process\'s first N requests are warm-up (phase = "warmup"\n'
                                "in the records, left out of the analysis)", kind="integer", minimum=0)
    warmup_s: float = _key(0.0, "any kind: requests sent in the run's first S seconds are warm-up (the same)",
                           kind="number", minimum=0)
    users: tuple[int, ...] = _key((1, 2, 4, 8), "steps: list, or {start=1, factor=2, max=64}; constant: one number "
                                  "(default 1)")
    step_s: float = _key(10.0, "steps/poisson: hold time of each level; constant: duration", kind="number", above=0)
    spawn_rate: float = _key(100.0, "users started per second", kind="number", above=0)
    think_time_s: float = _key(0.0, "closed loop: pause between a user's requests", kind="number", minimum=0)
    rate: tuple[float, ...] = _key((), "poisson: requests/s, or a list of rates stepped every step_s", example="5.0")
    max_users: int = _key(64, "poisson, trace: user pool that sends the scheduled requests (search: see docs)")
    arrival: str = _key("poisson", "poisson | constant (evenly spaced) | gamma (bursty, as vLLM's --burstiness)",
                        kind="text", choices=ARRIVALS)
    burstiness: float = _key(1.0, "gamma: shape factor; 1 = Poisson, < 1 burstier, > 1 more even (CV = 1/sqrt(b))",
                             kind="number", above=0)
    ramp: str = _key("none", "poisson: none | linear | exponential rise of the rate within each step, from\n"
                     "the previous step's rate (the first step from a tenth of its own)", kind="text", choices=RAMPS)
    trace: str | None = _key(None, "trace: JSONL or CSV rows with a timestamp (or interval_s) and input and\n"
                             "output token counts (BurstGPT, Mooncake columns understood)", example='"trace.jsonl"')
    speed: float = _key(1.0, "trace: replay this many times faster (2 = each request at half its offset)",
                        kind="number", above=0)
    time_unit: str = _key("s", "trace: unit of the timestamps, s or ms (intervals are always seconds)", kind="text",
                          choices=tuple(TIME_UNITS))
    max_rps: float = _key(0.0, "any kind: our own cap on requests/s across all workers; 0 = none", kind="number",
                          minimum=0)
    max_tokens_per_min: float = _key(0.0, "any kind: cap on tokens/min sent (prompt estimate + max_tokens); 0 = none",
                                     kind="number", minimum=0)
    retry: int = _key(0, "any kind: retries of a request the channel pushed back (429/529/503),\n"
                      "each after its back-off and recorded as a new request with retry_of; 0 = none",
                      kind="integer", minimum=0)
    min_requests: int = _key(0, "steps/constant: hold a step past step_s until N requests finished; 0 = off",
                             kind="integer", minimum=0)
    max_step_s: float = _key(0.0, "steps/constant: longest a step is held for min_requests; 0 = 4 x step_s",
                             kind="number", minimum=0)
    step_warmup_s: float = _key(0.0, "analysis leaves requests started in each step's first S seconds out",
                                kind="number", minimum=0)
    search: SearchSpec | None = _key(None, inline=SearchSpec)

    @property
    def open_loop(self) -> bool:
        """Arrivals are scheduled (requests/s), whatever the channel does: Poisson, a trace, a search over rate."""
        return self.kind in OPEN_LOOP_KINDS or (self.search is not None and self.search.over == "rate")

    @property
    def step_cap_s(self) -> float:
        """The longest a step is held while it gathers `min_requests` (never less than step_s)."""
        return max(self.step_s, self.max_step_s or 4 * self.step_s)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx, base_dir: Path = Path()) -> LoadSection:
        w = "[load]"
        if data is None:
            raise ctx.fail(w, "missing; every scenario needs a [load] section")
        evidence = ("min_requests", "max_step_s")
        search_keys = key_names(SearchSpec)
        d = ctx.table(data, w, key_names(cls))
        kind = ctx.text(d, "kind", w, cls.kind, choices=LOAD_KINDS)
        assert kind is not None
        allowed = {
            "steps": {"users", "step_s", "spawn_rate", "think_time_s", *evidence},
            "constant": {"users", "step_s", "spawn_rate", "think_time_s", *evidence},
            "poisson": {"rate", "step_s", "spawn_rate", "max_users", "arrival", "burstiness", "ramp"},
            "trace": {"trace", "speed", "time_unit", "spawn_rate", "max_users"},
            "search": {"spawn_rate", "think_time_s", "max_users", "arrival", *search_keys},
        }[kind]
        extra = sorted(set(d) - allowed - {"kind", *_ANY_KIND})
        if extra:
            raise ctx.fail(f"{w} {extra[0]}", f"not used by kind = {kind!r}; its keys: {', '.join(sorted(allowed))}")
        read = ctx.read(cls, d, w)
        if read["step_warmup_s"] >= read["step_s"]:
            raise ctx.fail(f"{w} step_warmup_s", f"must be shorter than step_s ({read['step_s']:g}), "
                                                 f"got {read['step_warmup_s']:g}")
        if kind == "search":
            search = SearchSpec.parse(d, ctx)
            return cls(**{**read, "step_s": search.max_probe_s}, search=search,
                       max_users=ctx.number(d, "max_users", w, math.ceil(search.max_level) if search.over == "users"
                                            else RATE_POOL, integer=True, minimum=1))
        if kind == "trace":
            trace = ctx.text(d, "trace", w)
            if trace is None:
                raise ctx.fail(f"{w} trace", "missing; kind = \"trace\" replays a trace file (JSONL or CSV)")
            path = (base_dir / trace).resolve()
            if not path.is_file():
                raise ctx.fail(f"{w} trace", f"file {path} does not exist")
            rows = load_trace(str(path), read["time_unit"])  # every row checked now, before any load starts
            span = trace_span_s(rows, read["speed"])
            return cls(**{**read, "step_s": span}, rate=(len(rows) / span,), trace=str(path),
                       max_users=ctx.number(d, "max_users", w, cls.max_users, integer=True, minimum=1))
        if kind == "poisson":
            rate = d.get("rate")
            rates: list[Any] = rate if isinstance(rate, list) else [rate]
            if rate is None or not rates or any(isinstance(r, bool) or not isinstance(r, (int, float)) or r <= 0 for r in rates):
                raise ctx.fail(f"{w} rate", f"expected requests/s > 0 or a list of them, got {_show(rate)}")
            if "burstiness" in d and read["arrival"] != "gamma":
                raise ctx.fail(f"{w} burstiness", 'only applies to arrival = "gamma"')
            return cls(**read, rate=tuple(float(r) for r in rates),
                       max_users=ctx.number(d, "max_users", w, cls.max_users, integer=True, minimum=1))
        users: tuple[int, ...]
        if kind == "constant":
            users = (ctx.number(d, "users", w, cls.users[0], integer=True, minimum=1),)
        else:
            users = _user_ladder(d.get("users", list(cls.users)), f"{w} users", ctx)
        if read["max_step_s"] and read["max_step_s"] < read["step_s"]:
            raise ctx.fail(f"{w} max_step_s", f"must be at least step_s ({read['step_s']:g}) or 0, "
                           f"got {read['max_step_s']:g}")
        return cls(**read, users=users)

    def to_dict(self) -> dict[str, Any]:
        """Only the keys this kind uses, so the dict parses back to the same section."""
        common = {k: getattr(self, k) for k in _ANY_KIND}
        if self.kind == "trace":
            return {"kind": self.kind, "trace": self.trace, "speed": self.speed, "time_unit": self.time_unit,
                    "spawn_rate": self.spawn_rate, "max_users": self.max_users, **common}
        out: dict[str, Any] = {"kind": self.kind, "step_s": self.step_s, "spawn_rate": self.spawn_rate, **common}
        if self.search is not None:
            return {"kind": self.kind, "spawn_rate": self.spawn_rate, "think_time_s": self.think_time_s,
                    "max_users": self.max_users, "arrival": self.arrival, **self.search.to_dict(), **common}
        if self.kind == "poisson":
            extra = {"burstiness": self.burstiness} if self.arrival == "gamma" else {}
            return {**out, "rate": list(self.rate), "max_users": self.max_users, "arrival": self.arrival, **extra,
                    "ramp": self.ramp}
        users: Any = self.users[0] if self.kind == "constant" else list(self.users)
        return {**out, "users": users, "think_time_s": self.think_time_s, "min_requests": self.min_requests,
                "max_step_s": self.max_step_s}

    def limit_users(self, cap: int) -> LoadSection:
        """`--users N`: constant runs N users, a ramp stops at N, a Poisson pool holds N, a search tops at N."""
        if self.search is not None and self.search.over == "users":
            spec = dataclasses.replace(self.search, max_level=float(cap), min_level=min(self.search.min_level, cap))
            return dataclasses.replace(self, search=spec, max_users=cap)
        if self.open_loop:
            return dataclasses.replace(self, max_users=cap)
        if self.kind == "constant":
            return dataclasses.replace(self, users=(cap,))
        ladder = tuple(u for u in self.users if u < cap) + (cap,)
        return dataclasses.replace(self, users=ladder)


def _user_ladder(value: Any, where: str, ctx: _Ctx) -> tuple[int, ...]:
    if isinstance(value, dict):
        d = ctx.table(value, where, ("start", "factor", "max"))
        start = ctx.number(d, "start", where, 1, integer=True, minimum=1)
        factor = ctx.number(d, "factor", where, 2, above=1)
        top = ctx.number(d, "max", where, integer=True, minimum=start)
        ladder = [start]
        while ladder[-1] < top:
            ladder.append(min(top, max(ladder[-1] + 1, round(ladder[-1] * factor))))
        return tuple(ladder)
    if not isinstance(value, list) or not value:
        raise ctx.fail(where, f"expected a list of user counts or {{start, factor, max}}, got {_show(value)}")
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ctx.fail(where, f"every user count must be an integer >= 1, got {_show(v)}")
    return tuple(value)


@dataclass(frozen=True)
class StopSection:
    TABLE: ClassVar[str] = "stop"

    duration_s: float = _key(0.0, "cap on the whole run; 0 = the load plan's length", kind="number", minimum=0)
    max_requests: int = _key(0, "0 = unlimited", kind="integer", minimum=0)
    max_tokens: int = _key(0, "token budget (input + output, all workers); 0 = unlimited", kind="integer", minimum=0)
    drain_s: float | None = _key(None, "a hard drain: at the end, in-flight streams get this long to finish;\n"
                                 "unset = derived when the plan ends: 2 x the longest e2e/TTFT of the last\n"
                                 "step or the run's p99 e2e, at least drain_min_s, at most 600 s",
                                 kind="number", minimum=0, example="20")
    drain_min_s: float = _key(30.0, "the floor of the derived drain (and the drain of a Ctrl-C)", kind="number",
                              minimum=0)
    breakpoint_error_rate: float = _key(0.0, "stop after a whole step above this error rate; 0 = off",
                                        kind="number", minimum=0)
    breakpoint_ttft_p95_s: float = _key(0.0, "stop after a whole step above this TTFT p95; 0 = off", kind="number",
                                        minimum=0)
    config_errors: int = _key(5, "stop after this many configuration errors in a row (auth, unknown model,\n"
                              "wrong base URL; counted across workers), with doctor's fix; 0 = off",
                              kind="integer", minimum=0)
    storm_error_rate: float = _key(0.8, "error-storm breaker (0 = off): more than this share of load errors\n"
                                   "(429, 5xx, timeouts, ...) for storm_s seconds pauses every user",
                                   kind="number", minimum=0)
    storm_s: float = _key(10.0, "the storm's window, and the wait between the breaker's probe requests",
                          kind="number", above=0)
    storm_probes: int = _key(3, "failed probes after which the breaker stops the run (a probe that succeeds\n"
                             "resumes it)", kind="integer", minimum=1)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> StopSection:
        w = "[stop]"
        d = ctx.table(data, w, key_names(cls))
        read = ctx.read(cls, d, w)
        for key in ("breakpoint_error_rate", "storm_error_rate"):
            if read[key] > 1:
                raise ctx.fail(f"{w} {key}", f"is a fraction between 0 and 1, got {read[key]}")
        return cls(**read)


def parse_slo(data: Any, ctx: _Ctx) -> Slo:
    """`[slo]`: the thresholds it names (none named: the default ones), `target`, `max_error_rate`."""
    w = "[slo]"
    d = ctx.table(data, w, tuple(f.name for f in dataclasses.fields(Slo)))
    named = {f"{m}_s": ctx.number(d, f"{m}_s", w, above=0) for m in SLO_METRICS if f"{m}_s" in d}
    thresholds = named or {f"{m}_s": getattr(DEFAULT_SLO, f"{m}_s") for m in SLO_METRICS}
    target = ctx.number(d, "target", w, DEFAULT_SLO.target, above=0)
    max_error_rate = ctx.number(d, "max_error_rate", w, DEFAULT_SLO.max_error_rate, minimum=0)
    for key, value in (("target", target), ("max_error_rate", max_error_rate)):
        if value > 1:
            raise ctx.fail(f"{w} {key}", f"is a share between 0 and 1, got {value}")
    return Slo(**{**{f"{m}_s": None for m in SLO_METRICS}, **thresholds}, target=target,
               max_error_rate=max_error_rate)


@dataclass(frozen=True)
class Check:
    """One threshold of `[thresholds] checks`: its expression (`tokenload.thresholds`), and whether it stops the
    run once decided breached."""

    expr: str
    abort_on_fail: bool = _key(False, kind="flag")


@dataclass(frozen=True)
class ThresholdsSection:
    """`[thresholds]`: the gates judged at the end of the run (and by analyze), checked before it starts."""

    TABLE: ClassVar[str] = "thresholds"
    HELP: ClassVar[str] = ("CI gates over summary.json's numbers, judged at the end (docs/ci.md): run,\n"
                           "analyze and compare exit 99 when one is breached; --threshold adds more")

    checks: tuple[Check, ...] = _key((), 'NAME OP BOUND; or { expr = "...", abort_on_fail = true }:\n'
                                     "stop the run once the live statistics decide it is breached",
                                     example='["ttft.p95 < 1.2", "error_rate < 0.01"]')
    inconclusive: str = _key("pass", "an interval straddling the bound: pass (not breached) or fail", kind="text",
                             choices=INCONCLUSIVE_CHOICES)

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> ThresholdsSection:
        w = "[thresholds]"
        d = ctx.table(data, w, key_names(cls))
        items = d.get("checks", [])
        if not isinstance(items, list):
            raise ctx.fail(f"{w} checks", f"expected a list of expressions, got {_show(items)}")
        checks = []
        for item in items:
            where = f"{w} checks"
            entry = ctx.table({"expr": item} if isinstance(item, str) else item, where, ("expr", *key_names(Check)))
            check = Check(expr=ctx.text(entry, "expr", where) or "", **ctx.read(Check, entry, where))
            try:
                parse_threshold(check.expr, abort_on_fail=check.abort_on_fail)
            except ConfigError as exc:
                raise ctx.fail(where, str(exc)) from None
            checks.append(check)
        return cls(**ctx.read(cls, d, w), checks=tuple(checks))

    def with_exprs(self, exprs: list[str]) -> ThresholdsSection:
        """`tokenload run --threshold EXPR ...`: these checks besides the scenario's (validated alike)."""
        for expr in exprs:
            parse_threshold(expr)  # a bad one is its own one-line error
        return dataclasses.replace(self, checks=(*self.checks, *(Check(expr.strip()) for expr in exprs)))


@dataclass(frozen=True)
class ServerSection:
    """`[server]`: where the inference server publishes Prometheus metrics (see docs/server-metrics.md)."""

    TABLE: ClassVar[str] = "server"
    HELP: ClassVar[str] = "the inference server's own Prometheus metrics, sampled during the run"

    metrics_url: tuple[str, ...] = _key((), "default: <base URL's origin>/metrics when it answers",
                                        example='["http://gpu-host:8000/metrics"]')
    interval_s: float = _key(1.0, "seconds between scrapes", kind="number", minimum=0.1)
    discover: bool = _key(True, "false: without metrics_url, do not try <origin>/metrics", kind="flag")

    @classmethod
    def parse(cls, data: Any, ctx: _Ctx) -> ServerSection:
        w = "[server]"
        d = ctx.table(data, w, key_names(cls))
        urls: Any = d.get("metrics_url", [])
        urls = [urls] if isinstance(urls, str) else urls
        if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
            raise ctx.fail(f"{w} metrics_url", f"expected a list of URLs, got {_show(urls)}")
        return cls(**ctx.read(cls, d, w), metrics_url=tuple(cls.url(u, ctx, f"{w} metrics_url") for u in urls))

    @staticmethod
    def url(value: str, ctx: _Ctx, where: str) -> str:
        parts = urlsplit(value.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ctx.fail(where, f"expected an http(s) URL such as http://host:8000/metrics, got {_show(value)}")
        return value.strip()


@dataclass(frozen=True)
class Scenario:
    """A validated scenario; immutable, JSON round-trippable via `to_dict` / `from_dict`."""

    name: str = field(metadata={"key": Key("default: file stem", example='"demo"')})
    load: LoadSection
    description: str = _key("", example='"..."')
    seed: int = _key(0, "prompt texts, lengths and arrivals are reproducible", kind="integer")
    channel: ChannelSection = field(default_factory=ChannelSection)
    prompt: PromptSection = field(default_factory=PromptSection)
    output: OutputSection = field(default_factory=OutputSection)
    stop: StopSection = field(default_factory=StopSection)
    session: SessionSection | None = None
    design: DesignSection | None = None
    slo: Slo = DEFAULT_SLO
    server: ServerSection = field(default_factory=ServerSection)
    thresholds: ThresholdsSection = field(default_factory=ThresholdsSection)

    @classmethod
    def from_dict(cls, data: Any, source: str, base_dir: Path, default_name: str) -> Scenario:
        ctx = _Ctx(source)
        d = ctx.table(data, "top level", ("name", "description", "seed", "channel", "prompt", "session", "output", "load",
                                          "stop", "slo", "server", "design", "thresholds"))
        session = SessionSection.parse(d["session"], ctx) if "session" in d else None
        trace = isinstance(d.get("load"), dict) and d["load"].get("kind") == "trace"
        for section in ("session", "design"):
            if section in d and trace:
                raise ctx.fail(f"[{section}]", f"a trace replay sends the trace's own lengths; remove [{section}]")
        channel = ChannelSection.parse(d.get("channel"), ctx)
        prompt = PromptSection.parse(d.get("prompt"), ctx, base_dir, session is not None)
        output = OutputSection.parse(d.get("output"), ctx)
        design = DesignSection.parse(d["design"], ctx) if "design" in d else None
        if design is not None:
            DesignSection.check(ctx, prompt, output, channel.models)
        return cls(
            **ctx.read(cls, d, "top level"),
            session=session,
            design=design,
            name=ctx.text(d, "name", "top level", default_name) or default_name,
            description=(ctx.text(d, "description", "top level") or "") if d.get("description") else "",
            channel=channel,
            prompt=prompt,
            output=output,
            load=LoadSection.parse(d.get("load"), ctx, base_dir),
            stop=StopSection.parse(d.get("stop"), ctx),
            slo=parse_slo(d["slo"], ctx) if "slo" in d else DEFAULT_SLO,
            server=ServerSection.parse(d.get("server"), ctx),
            thresholds=ThresholdsSection.parse(d.get("thresholds"), ctx),
        )

    def to_dict(self) -> dict[str, Any]:
        """The resolved scenario in the TOML's shape (shorthands expanded, `None`s dropped)."""

        def plain(value: Any) -> Any:
            if isinstance(value, (Distribution, LoadSection)):
                return value.to_dict()
            if dataclasses.is_dataclass(value):
                return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)
                        if getattr(value, f.name) is not None}
            if isinstance(value, tuple):
                return [plain(v) for v in value]
            return value

        data = plain(self)
        if not data["channel"]["models"]:
            del data["channel"]["models"]
        return data

    def with_server_metrics(self, urls: list[str] | None) -> Scenario:
        """`tokenload run --server-metrics URL ...`: these URLs instead of the scenario's (validated alike)."""
        if not urls:
            return self
        given = self.server_metrics_urls(urls)
        return dataclasses.replace(self, server=dataclasses.replace(self.server, metrics_url=given))

    @staticmethod
    def server_metrics_urls(urls: list[str]) -> tuple[str, ...]:
        """`--server-metrics URL ...` (run, probe) checked like `[server] metrics_url`."""
        return tuple(ServerSection.url(u, _Ctx(""), "--server-metrics") for u in urls)

    def with_overrides(self, *, users: int | None = None, duration_s: float | None = None) -> Scenario:
        """Apply `tokenload run --users/--duration` (validated like the file's own values)."""
        scenario = self
        if users is not None:
            if users < 1:
                raise ConfigError(f"--users must be at least 1, got {users}")
            scenario = dataclasses.replace(scenario, load=scenario.load.limit_users(users))
        if duration_s is not None:
            if duration_s <= 0:
                raise ConfigError(f"--duration must be greater than 0 seconds, got {duration_s:g}")
            scenario = dataclasses.replace(scenario, stop=dataclasses.replace(scenario.stop, duration_s=duration_s))
        return scenario


SCHEMA_HELP = "Schema (all sections optional except `[load]`):\n\n" + "\n\n".join(
    "\n".join(f"    {line}" for line in schema_lines(section))
    for section in (Scenario, ChannelSection, PromptSection, SessionSection, OutputSection, DesignSection,
                    LoadSection, StopSection, ThresholdsSection, ServerSection)) + "\n"


def packaged(name: str) -> Path:
    """The path of a scenario shipped with tokenload (`demo` -> .../scenarios/demo.toml)."""
    return packaged_file(f"{name}.toml")


def packaged_names() -> list[str]:
    """The names of the scenarios shipped with tokenload (`demo`, `ramp`, `search`, ...), sorted."""
    return sorted(path.stem for path in packaged_file("").glob("*.toml"))


def packaged_file(name: str) -> Path:
    """The path of a file shipped in tokenload's scenarios folder (scenarios, datasets)."""
    spec = importlib.util.find_spec("tokenload.scenarios")  # a data folder: found, not imported
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent / name


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a scenario: a TOML file, a resolved `.json`, or a packaged name like `demo`."""
    p = Path(path)
    if not p.is_file() and p.suffix == "" and packaged(str(path)).is_file():  # a folder named "demo" is no scenario
        p = packaged(str(path))
    if not p.is_file():
        raise ConfigError(f"scenario file {path} does not exist; give a .toml path or a packaged name such as demo")
    try:
        text = p.read_text(encoding="utf-8")
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{p.name}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read scenario file {p}: {exc}") from None
    return Scenario.from_dict(data, p.name, p.parent, p.stem)
