"""What `tokenload run` hands to the Locust processes it starts, how they read it, and the scenario bound to it.

Locust runs in a child process (it monkey-patches the interpreter with gevent),
so the resolved channel travels in one environment variable. The environment,
unlike argv, is not visible to other users of the machine, and it is never
written to the run directory: there, only `Channel.public()` appears.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import asdict

from tokenload.channel import Channel, ChannelFlags, Resolution, resolve
from tokenload.workload.scenario import Scenario

CHANNEL_ENV = "TOKENLOAD_CHANNEL"


def channel_to_env(channel: Channel) -> dict[str, str]:
    data = asdict(channel)
    data["extra_headers"] = dict(channel.extra_headers)
    return {CHANNEL_ENV: json.dumps(data)}


def channel_from_env() -> Channel | None:
    text = os.environ.get(CHANNEL_ENV)
    return Channel(**json.loads(text)) if text else None


def scenario_layer(scenario: Scenario) -> dict[str, str | None]:
    """The scenario's `[channel]` table as `channel.resolve()`'s scenario layer (defaults, not flags)."""
    section = scenario.channel
    return {"protocol": section.protocol, "base_url": section.base_url,
            "model": section.models[0] if section.models else None}


def resolve_scenario_channel(scenario: Scenario, label: str, flags: ChannelFlags,
                             models: Sequence[str] = ()) -> tuple[Scenario, Resolution]:
    """Resolve the channel with the scenario as a layer; the scenario's model list follows the result.

    A scenario may list several models (requests pick among them); that list
    stands only while the model comes from the scenario layer. A model set by a
    flag, the environment or a settings file replaces it, as any layer above
    the scenario does; several `models` (`run --model` repeated) replace it all.
    """
    resolution = resolve(**flags, scenario=scenario_layer(scenario), scenario_label=label)
    if len(models) > 1 or resolution.sources.get("model") != label:
        chosen = tuple(dict.fromkeys(models)) if len(models) > 1 else (resolution.channel.model,)
        scenario = dataclasses.replace(scenario, channel=dataclasses.replace(scenario.channel, models=chosen))
    return scenario, resolution


def bind(scenario: Scenario, channel: Channel) -> tuple[Scenario, Channel]:
    """A scenario and a channel made consistent: the models to send to, the scenario's timeouts."""
    if not scenario.channel.models:
        scenario = dataclasses.replace(scenario, channel=dataclasses.replace(scenario.channel, models=(channel.model,)))
    channel = dataclasses.replace(channel, first_token_timeout_s=scenario.channel.first_token_timeout_s,
                                  idle_timeout_s=scenario.channel.idle_timeout_s)
    return scenario, channel
