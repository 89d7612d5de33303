"""Simulator profiles: every knob of the behaviour model, with validation.

A profile is a TOML file of top-level keys (one per `Profile` field) plus an
optional `[faults]` table mapping a fault spec (the same text as a prompt
marker's body, see `tokenload.sim.faults`) to the probability of injecting it.
`extends = "NAME"` starts from another profile, so `peak` is `offpeak` plus a
`load` factor and nothing else. Each field's help text lives in its metadata so
that `tokenload sim --help` and the package docstring are generated from the
same place the defaults are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tokenload.compat import tomllib
from tokenload.dayclock import DAY_S, day_hour
from tokenload.errors import ConfigError
from tokenload.modelsize import size_from_id

EOS_DISTRIBUTIONS = ("uniform", "exponential", "lognormal")
PREAMBLE_MODES = ("first_token", "arrival")


def _knob(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class Profile:
    """Every knob of the simulated channel; times are for a 7B model at `load` 1."""

    models: list[str] = _knob(["sim-7b", "sim-30b"], "served model ids, the first being the default one clients should pick; `--model` replaces the list")
    slots: int = _knob(32, "concurrent sequences one replica decodes (continuous batching); more requests wait in the queue", min=1)
    replicas: int = _knob(1, "independent engine replicas per model behind the channel, each with `slots`; a request goes to the least busy one", min=1)
    max_queue: int = _knob(0, "waiting requests per model beyond which new ones get 529 overloaded (Anthropic) / 503 (OpenAI); 0 = unbounded", min=0)
    prefill_base_s: float = _knob(0.05, "prefill time `a` of `a + b * n^k` (n = input tokens)", min=0.0)
    prefill_per_token_s: float = _knob(0.0004, "prefill coefficient `b` of `a + b * n^k`", min=0.0)
    prefill_exponent: float = _knob(0.85, "prefill exponent `k`: 1 linear, < 1 sub-linear in input length", min=0.01)
    prefill_interference: float = _knob(0.15, "decode steps run this fraction slower while a newcomer's prefill is in progress on the replica", min=0.0)
    decode_base_s: float = _knob(0.02, "time of one decode step with one active sequence (TPOT at batch size 1)", min=0.0)
    decode_per_seq_s: float = _knob(0.0004, "extra decode-step time per additional active sequence (a batch of 32 steps slower than a batch of 1)", min=0.0)
    prefix_cache_tokens: int = _knob(1_000_000, "prompt-prefix tokens each model keeps in its prompt cache (LRU, 16-token blocks): cached tokens skip prefill and are reported in usage (Anthropic only with cache_control, OpenAI automatically); 0 = no prompt caching, as behind a relay that strips it", min=0)
    model_size_exponent: float = _knob(0.63, "time scales as (size / 7B)^x, size parsed from the model id (`sim-30b` -> 30, `270m` -> 0.27, `8x7b` -> 56): 0.63 makes 30B about 2.5x 7B", min=0.0)
    load: float = _knob(1.0, "other tenants' load: multiplies prefill and decode times and divides the effective slots (peak > 1)", min=0.1)
    load_by_hour: list[float] = _knob([], "24 multipliers of `load`, one per hour of the simulated local day (first = 00:00-01:00); empty = `load` all day", min=0.1, length=24)
    time_scale: float = _knob(1.0, "speed of the simulated day for `load_by_hour`: N makes a day last 24 h / N (hour = (local time x N) mod 24 h + day_phase_h); `tokenload sim --time-scale`", min=0.001)
    day_phase_h: float = _knob(0.0, "hours added to the simulated clock (shifts the day); `tokenload sim --day-phase`", min=0.0, max=24.0)
    noise: float = _knob(0.0, "sigma of a mean-1 log-normal factor on every prefill and decode step; 0 = deterministic", min=0.0)
    seed: int = _knob(0, "seed of every random draw (noise, early stops, fault rates)")
    default_max_tokens: int = _knob(256, "output tokens when an OpenAI request gives no limit (Anthropic requires max_tokens)", min=1)
    max_output_tokens: int = _knob(32768, "largest accepted max_tokens; above it -> 400 invalid request", min=1)
    eos_probability: float = _knob(0.0, "probability that a request stops early (end_turn / stop) instead of at max_tokens; ignore_eos disables it", min=0.0, max=1.0)
    eos_distribution: str = _knob("lognormal", f"length of an early stop: one of {', '.join(EOS_DISTRIBUTIONS)} (uniform over [min_tokens, max_tokens])", choices=EOS_DISTRIBUTIONS)
    eos_mean_tokens: float = _knob(120.0, "mean (exponential) or median (lognormal) early-stop length", min=1.0)
    eos_sigma: float = _knob(0.6, "sigma of the lognormal early-stop length", min=0.0)
    thinking_tokens: int = _knob(24, "thinking tokens a request gets when it asks for thinking (capped by budget_tokens and max_tokens - 1)", min=0)
    preamble: str = _knob("first_token", "when message_start / the role chunk / response.created are sent: with the first token (vLLM) or at arrival (Anthropic API); response headers always go at arrival", choices=PREAMBLE_MODES)
    rate_limit_rpm: int = _knob(0, "requests per minute per channel before 429 + retry-after; 0 = off", min=0)
    rate_limit_tpm: int = _knob(0, "tokens (input + max_tokens) per minute before 429; 0 = off", min=0)
    max_concurrency: int = _knob(0, "requests in flight (queued or decoding) before 429; 0 = off", min=0)
    faults: dict[str, float] = _knob({}, "[faults] table: fault spec (marker body) -> probability per streaming request")


_FIELDS = {f.name: f for f in dataclasses.fields(Profile)}
_REFERENCE_SIZE_B = 7.0


def knobs_help() -> str:
    """One line per knob with default and meaning, for docstrings and --help."""
    lines = []
    for f in dataclasses.fields(Profile):
        default = f.default_factory() if callable(f.default_factory) else f.default
        lines.append(f"  {f.name} = {default!r}\n      {f.metadata['help']}")
    return "\n".join(lines)


def model_scale(profile: Profile, model: str) -> float:
    """Time factor of `model` relative to 7B: (size/7)^exponent, 1 when no size is in the id."""
    size = size_from_id(model)
    return 1.0 if size is None else (size / _REFERENCE_SIZE_B) ** profile.model_size_exponent


def load_at(profile: Profile, t: float) -> float:
    """The load factor at unix time `t`: `load`, times the hour's `load_by_hour` entry when there is a curve."""
    if not profile.load_by_hour:
        return profile.load
    hour = day_hour(t, DAY_S / profile.time_scale, profile.day_phase_h)
    return profile.load * profile.load_by_hour[int(hour) % 24]


def effective_slots(profile: Profile, load: float | None = None) -> int:
    """Slots left to our requests when other tenants load the channel by `load` (default: the profile's)."""
    return max(1, math.floor(profile.slots / max(profile.load if load is None else load, 1.0)))


def _check(name: str, value: Any, where: str) -> Any:
    f = _FIELDS.get(name)
    if f is None:
        raise ConfigError(f"{where}: unknown profile key {name!r} (known: {', '.join(_FIELDS)})")
    kind = f.type
    meta = f.metadata
    bad = f"{where}: {name}: expected {kind}, got {type(value).__name__} {value!r}"
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(bad)
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(bad)
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            raise ConfigError(bad)
    elif kind == "list[str]":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where}: {name}: expected a non-empty list of strings, got {value!r}")
        value = list(value)
    elif kind == "list[float]":
        if not isinstance(value, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
            raise ConfigError(f"{where}: {name}: expected a list of numbers, got {value!r}")
        if value and "length" in meta and len(value) != meta["length"]:
            raise ConfigError(f"{where}: {name}: expected {meta['length']} numbers (or none), got {len(value)}")
        if "min" in meta and any(v < meta["min"] for v in value):
            raise ConfigError(f"{where}: {name}: every entry must be >= {meta['min']}, got {min(value)!r}")
        return [float(v) for v in value]
    elif kind == "dict[str, float]":
        from tokenload.sim.faults import parse_spec

        if not isinstance(value, dict):
            raise ConfigError(bad)
        for spec, rate in value.items():
            if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
                raise ConfigError(f"{where}: faults.{spec}: expected a probability in [0, 1], got {rate!r}")
            try:
                parse_spec(spec)
            except ValueError as exc:
                raise ConfigError(f"{where}: faults.{spec}: {exc}") from None
        value = {k: float(v) for k, v in value.items()}
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"{where}: {name}: must be >= {meta['min']}, got {value!r}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"{where}: {name}: must be <= {meta['max']}, got {value!r}")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{where}: {name}: must be one of {', '.join(meta['choices'])}, got {value!r}")
    return value


def with_overrides(profile: Profile, where: str = "overrides", **overrides: Any) -> Profile:
    """`profile` with validated replacements; unknown keys or wrong types raise ConfigError."""
    checked = {k: _check(k, v, where) for k, v in overrides.items()}
    return dataclasses.replace(profile, **checked)


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in tokenload/sim/profiles/."""
    root = resources.files("tokenload.sim") / "profiles"
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".toml"))


def _read(name_or_path: str, seen: tuple[str, ...]) -> Profile:
    path = Path(name_or_path)
    if path.suffix == ".toml" or path.is_file():  # a folder named "peak" (a demo run) is no profile
        where = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read profile: {exc.strerror}") from None
    else:
        resource = resources.files("tokenload.sim") / "profiles" / f"{name_or_path}.toml"
        if not resource.is_file():
            raise ConfigError(
                f"unknown profile {name_or_path!r}: give a TOML file or one of {', '.join(builtin_profiles())}"
            )
        where = f"profile {name_or_path}"
        text = resource.read_text(encoding="utf-8")
    if where in seen:
        raise ConfigError(f"{where}: extends loops back to itself")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: invalid TOML: {exc}") from None
    parent = data.pop("extends", None)
    if parent is not None and not isinstance(parent, str):
        raise ConfigError(f"{where}: extends: expected a profile name or file, got {parent!r}")
    base = _read(parent, (*seen, where)) if parent else Profile()
    return with_overrides(base, where, **data)


def load_profile(name_or_path: str | Path | None = None) -> Profile:
    """A built-in profile by name (`default`, `fast`, ...) or a TOML file; None = `default`."""
    return _read(str(name_or_path or "default"), ())
