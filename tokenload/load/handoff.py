"""What `tokenload run` hands to the Locust processes it starts, and how they read it.

Locust runs in a child process (it monkey-patches the interpreter with gevent),
so the resolved channel travels in one environment variable. The environment,
unlike argv, is not visible to other users of the machine, and it is never
written to the run directory: there, only `Channel.public()` appears.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from tokenload.channel import Channel

CHANNEL_ENV = "TOKENLOAD_CHANNEL"


def channel_to_env(channel: Channel) -> dict[str, str]:
    data = asdict(channel)
    data["extra_headers"] = dict(channel.extra_headers)
    return {CHANNEL_ENV: json.dumps(data)}


def channel_from_env() -> Channel | None:
    text = os.environ.get(CHANNEL_ENV)
    return Channel(**json.loads(text)) if text else None
