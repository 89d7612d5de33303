"""A `[design]` crosses prompt length, output length and model (balanced, seeded, per user); model sizes come from
ids or `[channel] model_sizes`; `run --model` repeated replaces the scenario's models."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tokenload.channel import add_channel_arguments, channel_flags
from tokenload.errors import ConfigError
from tokenload.load.handoff import resolve_scenario_channel
from tokenload.modelsize import model_size, size_from_id
from tokenload.workload.prompts import PromptSource
from tokenload.workload.scenario import Scenario


def scenario(**sections: Any) -> Scenario:
    return Scenario.from_dict({"load": {"users": [1, 2]}, **sections}, "s.toml", Path("."), "s")


DESIGNED = {"prompt": {"tokens": [64, 256, 1024]}, "output": {"max_tokens": [16, 64]},
            "channel": {"models": ["a-7b", "b-30b"]}}


@pytest.mark.parametrize(("model", "size"), [
    ("sim-7b", 7.0), ("judge-30b", 30.0), ("llama-3.1-70b-instruct", 70.0), ("mixtral-8x7b", 56.0),
    ("gemma-3-270m", 0.27), ("Qwen3-30B-A3B", 30.0), ("qwen2.5-1.5b", 1.5), ("claude-sonnet-4-20250514", None),
    ("gpt-4o", None), ("e5b", None),
])
def test_size_from_the_model_id(model: str, size: float | None) -> None:
    assert size_from_id(model) == size


def test_a_declared_size_wins_over_the_id() -> None:
    assert model_size("my-model", {"my-model": 30}) == 30.0
    assert model_size("sim-7b", {"my-model": 30}) == 7.0
    assert scenario(channel={"model_sizes": {"my-model": 30}}).channel.model_sizes == {"my-model": 30.0}


def test_a_factorial_design_sends_every_cell_once_per_block_in_each_users_own_order() -> None:
    source = PromptSource(scenario(**DESIGNED, design={}), ("a-7b", "b-30b"), salt=0)
    walks = {user: [source.next(user=user) for _ in range(24)] for user in ("u1", "u2")}
    for plans in walks.values():
        for block in (plans[:12], plans[12:]):
            cells = Counter((p.prompt_tokens_target, p.max_tokens, p.model) for p in block)
            assert len(cells) == 12 and set(cells.values()) == {1}
    orders = [[(p.prompt_tokens_target, p.max_tokens, p.model) for p in plans] for plans in walks.values()]
    assert orders[0] != orders[1]  # each user its own random order
    again = PromptSource(scenario(**DESIGNED, design={}), ("a-7b", "b-30b"), salt=0)
    assert [(p.prompt_tokens_target, p.max_tokens, p.model) for p in (again.next(user="u1") for _ in range(24))] \
        == orders[0]  # seeded


def test_a_design_crosses_what_a_sweep_moves_in_lockstep() -> None:
    swept = PromptSource(scenario(prompt={"tokens": [64, 256, 1024]}, output={"max_tokens": [16, 64, 256]}), ("m",), 0)
    lockstep = [swept.next() for _ in range(30)]
    crossed = PromptSource(scenario(prompt={"tokens": [64, 256, 1024]}, output={"max_tokens": [16, 64, 256]},
                                    design={}), ("m",), 0)
    design = [crossed.next(user=f"u{i % 3}") for i in range(90)]

    def r(plans: list[Any]) -> float:
        return float(np.corrcoef([p.prompt_tokens_target for p in plans], [p.max_tokens for p in plans])[0, 1])

    assert r(lockstep) == pytest.approx(1.0)
    assert abs(r(design)) < 0.05  # whole blocks: exactly balanced, so uncorrelated


def test_a_latin_design_balances_each_factor_in_a_block_of_points() -> None:
    source = PromptSource(scenario(**DESIGNED, design={"kind": "latin", "points": 6}), ("a-7b", "b-30b"), 0)
    block = [source.next(user="u") for _ in range(6)]
    assert Counter(p.prompt_tokens_target for p in block) == {64: 2, 256: 2, 1024: 2}
    assert Counter(p.max_tokens for p in block) == {16: 3, 64: 3}
    assert Counter(p.model for p in block) == {"a-7b": 3, "b-30b": 3}


@pytest.mark.parametrize(("sections", "message"), [
    ({"design": {"kind": "grid"}}, "[design] kind: must be one of factorial, latin"),
    ({"design": {"points": 4}}, '[design] points: only applies to kind = "latin"'),
    ({"design": {}, "prompt": {"tokens": {"dist": "uniform", "min": 10, "max": 90}}},
     "[prompt] tokens: a [design] crosses levels"),
    ({"design": {}}, "[design]: nothing to cross"),
    ({"design": {}, "session": {}}, "[design]: crosses [prompt] tokens levels"),
    ({"channel": {"model_sizes": {"m": 0}}}, "[channel] model_sizes m: must be greater than 0"),
    ({"channel": {"model_sizes": [30]}}, "[channel] model_sizes: expected a table"),
])
def test_bad_design_and_size_keys_are_one_line_naming_the_field(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        scenario(**sections)
    assert message in str(caught.value) and str(caught.value).startswith("s.toml: ")


def test_a_design_round_trips_through_the_resolved_scenario() -> None:
    designed = scenario(**DESIGNED, design={"kind": "latin", "points": 6})
    assert Scenario.from_dict(designed.to_dict(), "r.json", Path("."), "s") == designed


def test_run_model_given_twice_replaces_the_scenarios_models() -> None:
    parser = argparse.ArgumentParser()
    add_channel_arguments(parser, several_models=True)
    args = parser.parse_args(["--base-url", "http://127.0.0.1:9/v1", "--model", "judge-7b", "--model", "judge-30b"])
    resolved, resolution = resolve_scenario_channel(scenario(**DESIGNED), "scenario", channel_flags(args),
                                                    args.model)
    assert resolved.channel.models == ("judge-7b", "judge-30b") and resolution.channel.model == "judge-7b"
    once = parser.parse_args(["--model", "judge-7b"])
    resolved, _ = resolve_scenario_channel(scenario(**DESIGNED), "scenario", channel_flags(once), once.model)
    assert resolved.channel.models == ("judge-7b",)
