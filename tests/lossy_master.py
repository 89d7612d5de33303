"""A locustfile for tests: tokenload's own, on a master that drops its first acknowledgement of a batch.

The worker never hears that its first batch arrived, so it sends that batch
again: the master gets it twice, for real, over Locust's channel.
"""

from typing import Any

from locust import events
from locust.env import Environment

from tokenload.load.courier import ACK_MESSAGE
from tokenload.locustfiles.llm import LLMUser, ScenarioShape

__all__ = ["LLMUser", "ScenarioShape"]


@events.init.add_listener
def _drop_first_ack(environment: Environment, **_: Any) -> None:
    runner = environment.runner
    assert runner is not None
    send = runner.send_message
    dropped: list[int] = []

    def lossy(msg_type: str, data: Any = None, client_id: str | None = None) -> None:
        if msg_type == ACK_MESSAGE and data.get("seq") is not None and not dropped:
            dropped.append(data["seq"])
            return
        send(msg_type, data, client_id)

    runner.send_message = lossy  # type: ignore[method-assign]
