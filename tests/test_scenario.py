"""Scenario files and prompt generation, without Locust (fast: no processes, no network)."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from tokenload.errors import ConfigError
from tokenload.tokens import estimate_tokens
from tokenload.workload.datasets import load_dataset
from tokenload.workload.prompts import PromptSource, Sampler
from tokenload.workload.scenario import (
    DEFAULT_PROMPT_TOKENS,
    SCHEMA_HELP,
    ChannelSection,
    DesignSection,
    Distribution,
    Key,
    LoadSection,
    OutputSection,
    PromptSection,
    Scenario,
    SearchSpec,
    ServerSection,
    SessionSection,
    StopSection,
    ThresholdsSection,
    _Ctx,
    _keys,
    key_names,
    load_scenario,
    packaged,
)

SHIPPED = sorted(p.stem for p in packaged("demo").parent.glob("*.toml"))


def _write(tmp_path: Path, body: str, name: str = "case.toml") -> Path:
    path = tmp_path / name
    path.write_text(body, encoding="utf-8")
    return path


def _draws(value: object, n: int = 4000, seed: int = 1) -> list[int]:
    sampler = Sampler(Distribution.parse(value, "[prompt] tokens", _Ctx("t.toml")), random.Random(seed))
    return [sampler.draw() for _ in range(n)]


def test_the_required_scenarios_ship() -> None:
    assert {"demo", "smoke", "ramp", "prompt-sweep", "output-sweep", "peak-vs-offpeak"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_scenario_loads_and_round_trips(name: str, tmp_path: Path) -> None:
    scenario = load_scenario(name)
    assert scenario.name == name and scenario.description
    resolved = _write(tmp_path, json.dumps(scenario.to_dict()), f"{name}.json")
    assert load_scenario(resolved) == scenario


def test_demo_is_short_enough_for_tokenload_demo() -> None:
    demo = load_scenario("demo")
    assert demo.load.step_s * len(demo.load.users) <= 60


def test_fixed_and_sweep() -> None:
    assert set(_draws(300, 50)) == {300}
    assert _draws([10, 20, 30], 7) == [10, 20, 30, 10, 20, 30, 10]


def test_uniform_in_range_with_the_right_mean() -> None:
    values = _draws({"dist": "uniform", "min": 100, "max": 300})
    assert min(values) >= 100 and max(values) <= 300
    assert min(values) < 110 and max(values) > 290
    assert statistics.mean(values) == pytest.approx(200, rel=0.03)


def test_normal_clipped_to_its_bounds_with_the_right_mean() -> None:
    values = _draws({"dist": "normal", "mean": 500, "std": 50})
    assert statistics.mean(values) == pytest.approx(500, rel=0.02)
    assert statistics.stdev(values) == pytest.approx(50, rel=0.1)
    clipped = _draws({"dist": "normal", "mean": 100, "std": 100, "min": 20, "max": 150})
    assert min(clipped) == 20 and max(clipped) == 150


def test_lognormal_has_the_right_median_and_a_long_tail() -> None:
    values = _draws({"dist": "lognormal", "median": 400, "sigma": 0.6, "max": 20_000})
    assert statistics.median(values) == pytest.approx(400, rel=0.05)
    assert statistics.mean(values) > statistics.median(values) * 1.1
    assert min(values) >= 1 and max(values) <= 20_000


def _scenario(tmp_path: Path, prompt: str, extra: str = "") -> Scenario:
    return load_scenario(_write(tmp_path, f"[prompt]\n{prompt}\n[load]\nkind = 'constant'\nusers = 1\n{extra}"))


def test_synthetic_prompts_hit_their_target_and_are_unique(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path, "tokens = [64, 512]")
    source = PromptSource(scenario, ("sim-7b",), salt=3)
    plans = [source.next() for _ in range(20)]
    assert [p.prompt_tokens_target for p in plans[:4]] == [64, 512, 64, 512]
    assert all(estimate_tokens(p.prompt) == p.prompt_tokens_target == p.estimated_input_tokens for p in plans)
    assert len({p.prompt for p in plans}) == len(plans)
    # Another process (another salt) never repeats this one's texts.
    other = PromptSource(scenario, ("sim-7b",), salt=4)
    assert not {other.next().prompt for _ in range(20)} & {p.prompt for p in plans}


def test_shared_prefix_is_common_and_the_rest_unique(tmp_path: Path) -> None:
    scenario = _scenario(tmp_path, "tokens = 300\nshared_prefix_tokens = 200")
    source = PromptSource(scenario, ("sim-7b",), salt=1)
    plans = [source.next() for _ in range(5)]
    head = plans[0].prompt[: len(" ".join(plans[0].prompt.split()[:200]))]
    assert all(p.prompt.startswith(head) for p in plans)
    assert len({p.prompt for p in plans}) == 5
    assert all(estimate_tokens(p.prompt) == 300 for p in plans)
    unique = PromptSource(_scenario(tmp_path, "tokens = 300"), ("sim-7b",), salt=1)
    a, b = unique.next().prompt.split(), unique.next().prompt.split()
    assert a[:20] != b[:20]


def test_calibration_scales_prompts_by_the_server_count(tmp_path: Path) -> None:
    source = PromptSource(_scenario(tmp_path, "tokens = 400"), ("sim-7b",), salt=1)
    first = source.next()
    # The server counts twice what we estimate: the next prompts are built half as long.
    source.observe({"input_tokens_source": "server", "input_tokens": 2 * first.estimated_input_tokens}, first)
    later = source.next()
    assert later.prompt_tokens_target == 400
    assert later.estimated_input_tokens == pytest.approx(200, abs=2)


def test_dataset_replays_in_order_with_unique_markers(tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "first question"}\n\n{"text": "second question"}\n', encoding="utf-8")
    scenario = _scenario(tmp_path, 'dataset = "prompts.jsonl"')
    assert scenario.prompt.dataset == str(data.resolve())
    source = PromptSource(scenario, ("sim-7b",), salt=9)
    prompts = [source.next().prompt for _ in range(4)]
    assert [p.endswith(q) for p, q in zip(prompts, ["first question", "second question"] * 2)] == [True] * 4
    assert len(set(prompts)) == 4
    assert [row.prompt for row in load_dataset(str(data))] == ["first question", "second question"]


@pytest.mark.parametrize("lines, problem", [
    ('{"prompt": "ok"}\nnot json\n', "line 2: not valid JSON"),
    ('{"prompt": ""}\n', "line 1: expected an object"),
    ("\n\n", "holds no prompts"),
])
def test_bad_dataset_is_one_clear_line(tmp_path: Path, lines: str, problem: str) -> None:
    (tmp_path / "bad.jsonl").write_text(lines, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_dataset(str(tmp_path / "bad.jsonl"))
    assert problem in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("body, field, words", [
    # unknown keys
    ("[load]\nkind = 'constant'\nusers = 2\ncolour = 'red'\n", "[load] colour", "unknown key"),
    ("[load]\nkind = 'steps'\n[stop]\nmax_request = 5\n", "[stop] max_request", "unknown key"),
    ("lod = 1\n[load]\nkind = 'steps'\n", "top level lod", "unknown key"),
    ("[load]\nkind = 'steps'\n[prompt]\ntokens = { dist = 'uniform', min = 1, max = 5, mean = 3 }\n",
     "[prompt] tokens mean", "unknown key"),
    ("[load]\nkind = 'poisson'\nrate = 2\nusers = 4\n", "[load] users", "not used by kind"),
    # wrong types
    ("[load]\nkind = 'constant'\nusers = '4'\n", "[load] users", "expected an integer"),
    ("[load]\nkind = 'steps'\nstep_s = 'ten'\n", "[load] step_s", "expected a number"),
    ("[load]\nkind = 'steps'\n[output]\nignore_eos = 'yes'\n", "[output] ignore_eos", "expected true or false"),
    ("[load]\nkind = 'steps'\n[channel]\nmodels = 'sim-7b'\n", "[channel] models", "expected a list"),
    ("[load]\nkind = 'steps'\n[prompt]\ntokens = 12.5\n", "[prompt] tokens value", "expected an integer"),
    # impossible values
    ("[load]\nkind = 'steps'\nusers = [1, 0]\n", "[load] users", ">= 1"),
    ("[load]\nkind = 'ramp'\n", "[load] kind", "must be one of"),
    ("[load]\nkind = 'steps'\n[output]\nmax_tokens = 16\nmin_tokens = 32\n", "[output] min_tokens", "above"),
    ("[load]\nkind = 'steps'\n[prompt]\ntokens = 50\nshared_prefix_tokens = 100\n", "[prompt] tokens value",
     "at least 100"),
    ("[load]\nkind = 'steps'\n[stop]\nduration_s = -1\n", "[stop] duration_s", "at least 0"),
    ("[load]\nkind = 'steps'\n[stop]\ndrain_s = -1\n", "[stop] drain_s", "at least 0"),
    ("[load]\nkind = 'steps'\n[stop]\ndrain_min_s = 'long'\n", "[stop] drain_min_s", "expected a number"),
    ("[load]\nkind = 'steps'\nstep_s = 5\nstep_warmup_s = 5\n", "[load] step_warmup_s", "shorter than step_s"),
    ("[load]\nkind = 'steps'\nwarmup_s = -2\n", "[load] warmup_s", "at least 0"),
    ("[load]\nkind = 'steps'\n[channel]\nprotocol = 'grpc'\n", "[channel] protocol", "must be one of"),
    ("[load]\nkind = 'steps'\n[prompt]\ndataset = 'missing.jsonl'\n", "[prompt] dataset", "does not exist"),
    ("[prompt]\ntokens = 5\n", "[load]", "missing"),
])
def test_validation_error_is_one_line_naming_the_field(tmp_path: Path, body: str, field: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_scenario(_write(tmp_path, body))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"case.toml: {field}"), message
    assert words in message, message


def test_overrides_are_validated_like_the_file() -> None:
    smoke = load_scenario("smoke")
    assert smoke.with_overrides(users=5).load.users == (5,)
    assert load_scenario("ramp").with_overrides(users=6).load.users == (1, 2, 4, 6)
    search = load_scenario("demo").with_overrides(users=6).load  # a search tops at N users
    assert search.search is not None and search.search.max_level == 6 and search.search.min_level == 4
    assert smoke.with_overrides(duration_s=3).stop.duration_s == 3
    with pytest.raises(ConfigError, match="--users"):
        smoke.with_overrides(users=0)
    with pytest.raises(ConfigError, match="--duration"):
        smoke.with_overrides(duration_s=0)


def test_missing_file_and_bad_toml_are_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_scenario(_write(tmp_path, "[load\n"))


def test_packaged_name_wins_over_a_folder_of_the_same_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tokenload run demo` inside a directory holding a `demo/` folder (e.g. a run directory)."""
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert load_scenario("demo").name == "demo"


def test_drain_is_derived_unless_set_and_both_warmups_round_trip(tmp_path: Path) -> None:
    """No `[stop] drain_s`: None (derived when the plan ends, floor drain_min_s); set, it is kept as given."""
    derived = load_scenario(_write(tmp_path, "[load]\nkind = 'steps'\nstep_s = 5\nwarmup_s = 30\nstep_warmup_s = 1\n"))
    assert derived.stop.drain_s is None and derived.stop.drain_min_s == 30.0
    assert (derived.load.warmup_s, derived.load.step_warmup_s) == (30.0, 1.0)
    fixed = load_scenario(_write(tmp_path, "[load]\nkind = 'steps'\n[stop]\ndrain_s = 0\ndrain_min_s = 5\n", "b.toml"))
    assert (fixed.stop.drain_s, fixed.stop.drain_min_s) == (0.0, 5.0)
    for scenario in (derived, fixed):
        again = Scenario.from_dict(json.loads(json.dumps(scenario.to_dict())), "resolved", tmp_path, "x")
        assert again == scenario


def test_a_searchs_max_probes_defaults_to_what_its_range_needs(tmp_path: Path) -> None:
    def spec(load: str):  # type: ignore[no-untyped-def]
        return load_scenario(_write(tmp_path, f'[load]\nkind = "search"\n{load}\n')).load.search

    assert spec("").max_probes == 29  # 1..256 users: 9 doublings, 7 bisections each with a second trial, 2 + 4 spare
    assert spec("min = 2\nmax = 32").max_probes == 19  # 5 + 2 x 4 + 2 + 4
    assert spec('over = "rate"').max_probes == 16  # 1..100 req/s to 10%: 8 + 2 x 3 + 2
    assert spec("max_probes = 5").max_probes == 5  # set, it wins
    assert load_scenario("search").load.search.max_probes == 29  # type: ignore[union-attr]


# ------------------------------------------------------------------ every key declared once

SECTIONS = (ChannelSection, SessionSection, OutputSection, DesignSection, LoadSection, StopSection, ThresholdsSection,
            ServerSection)


@pytest.mark.parametrize("section", SECTIONS, ids=lambda cls: cls.TABLE)
def test_an_empty_section_parses_to_its_declared_defaults(section: type) -> None:
    """The field defaults are the parse defaults: no second copy in parse (the search's range too)."""
    assert section.parse({}, _Ctx("t.toml")) == section()
    assert SearchSpec.parse({}, _Ctx("t.toml")) == SearchSpec()
    prompt = PromptSection.parse({}, _Ctx("t.toml"), Path("."))
    assert prompt == PromptSection(tokens=Distribution("fixed", {"value": DEFAULT_PROMPT_TOKENS}))


def _bad(key: Key) -> object:
    """A value the key's declaration refuses."""
    if key.kind == "flag":
        return "yes"
    if key.kind == "text":
        return "no such choice" if key.choices else ""
    if key.minimum is not None:
        return key.minimum - 1
    if key.above is not None:
        return key.above
    return 0.5 if key.kind == "integer" else "ten"


def _tables_for(section: str, tmp_path: Path) -> list[dict[str, object]]:
    """Scenario tables in which a key of `section` is used (the [load] keys: by one kind or another)."""
    if section != "load":
        return [{"load": {"kind": "constant"}}]
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_tokens": 8, "output_tokens": 8}\n', encoding="utf-8")
    return [{"load": load} for load in ({"kind": "steps"}, {"kind": "poisson", "rate": 1, "arrival": "gamma"},
                                        {"kind": "trace", "trace": str(trace)}, {"kind": "search"})]


def test_every_declared_check_is_the_one_parse_applies(tmp_path: Path) -> None:
    """Each key whose `Key` declares its check (a bound, a type, choices) refuses a bad value with a line that
    names the key: a declaration parse ignored would let it through."""
    checked = 0
    for section in (*SECTIONS, PromptSection, Scenario):
        table = getattr(section, "TABLE", None)
        for name, _, key in _keys(section):
            if key.kind == "custom":
                continue
            where = f"[{table}] {name}" if table else f"top level {name}"
            errors = []
            for base in _tables_for(table or "", tmp_path):
                data = json.loads(json.dumps(base))
                target = data if table is None else data.setdefault(table, {})
                target[name] = _bad(key)
                try:
                    Scenario.from_dict(data, "t.toml", tmp_path, "t")
                except ConfigError as exc:
                    errors.append(str(exc))
            assert any(e.startswith(f"t.toml: {where}: ") and "not used by kind" not in e for e in errors), (
                where, errors)
            checked += 1
    assert checked >= 40


def test_the_schema_has_a_line_for_every_key_the_parser_takes() -> None:
    for section in (*SECTIONS, PromptSection, SearchSpec, Scenario):
        for name in key_names(section):
            assert f"\n    {name} = " in SCHEMA_HELP, name
