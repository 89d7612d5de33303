"""An independent two-model server whose latency law is known: the judge of `tokenload run levers`.

It speaks OpenAI Chat Completions streaming (the scripted streams of
`fakeserver`) and serves `judge-7b` and `judge-30b`, the larger at `SCALE`
(2.5) times the smaller's TTFT and TPOT: a model-size exponent of
log 2.5 / log(30 / 7) = 0.63. With n prompt tokens (tokenload's own offline
count, which its synthetic prompts match) and k requests in flight at arrival
(this one included):

    TTFT = scale x (PREFILL_BASE_S + PREFILL_PER_TOKEN_S x n^PREFILL_EXPONENT) x (1 + LOAD_COEF x (k - 1))
    TPOT = scale x TPOT_S x (1 + LOAD_COEF x (k - 1))

No code of tokenload's simulator is used. Each stream's writes are due on one
clock from its start (`absolute_times`), so TPOT does not gather the loop's
lateness. `log` holds each answer's law values, the truth the tests read.

Standalone, for trying `tokenload run levers` by hand:
`python tests/judgeserver.py --port 18150` prints the base URL and serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import math
import signal
import threading
from dataclasses import dataclass
from typing import Any

from fakeserver import FakeServer, Received, Script, chat_stream, json_script

from tokenload.tokens import estimate_tokens

SCALE = 2.5
MODELS = {"judge-7b": 1.0, "judge-30b": SCALE}
PREFILL_BASE_S = 0.05
PREFILL_PER_TOKEN_S = 0.0004
PREFILL_EXPONENT = 0.85
TPOT_S = 0.02
LOAD_COEF = 0.1
SIZE_EXPONENT = math.log(SCALE) / math.log(30 / 7)


@dataclass(frozen=True)
class Answer:
    """What the law gave one request."""

    model: str
    input_tokens: int
    output_tokens: int
    in_flight: int
    ttft_s: float
    tpot_s: float


class JudgeServer(FakeServer):
    def __init__(self, port: int = 0, tpot_s: float = TPOT_S, prefill_base_s: float = PREFILL_BASE_S,
                 prefill_per_token_s: float = PREFILL_PER_TOKEN_S) -> None:
        self.tpot_s = tpot_s
        self.prefill_base_s = prefill_base_s
        self.prefill_per_token_s = prefill_per_token_s
        self.busy = 0
        self.log: list[Answer] = []
        super().__init__(port=port)
        self.absolute_times = True
        self.route(self._script)

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def law(self, model: str, n_in: int, in_flight: int) -> tuple[float, float]:
        """(TTFT, TPOT) of a request of `n_in` prompt tokens to `model` with `in_flight` requests in the server."""
        factor = MODELS[model] * (1 + LOAD_COEF * (in_flight - 1))
        return (factor * (self.prefill_base_s + self.prefill_per_token_s * n_in ** PREFILL_EXPONENT),
                factor * self.tpot_s)

    def _script(self, received: Received) -> Script:
        body = received.json()
        model = body.get("model")
        if model not in MODELS:
            return json_script(404, {"error": {"message": f"The model `{model}` does not exist",
                                               "type": "invalid_request_error", "param": "model",
                                               "code": "model_not_found"}})
        n_in = estimate_tokens(" ".join(str(m.get("content", "")) for m in body.get("messages", [])))
        n_out = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        ttft, tpot = self.law(model, n_in, self.busy + 1)  # _answer counts this one in right after
        self.log.append(Answer(model, n_in, n_out, self.busy + 1, ttft, tpot))
        return Script(writes=chat_stream(["tok "] * n_out, ttft, tpot, input_tokens=n_in, output_tokens=n_out,
                                         model=model, finish_reason="length"))

    async def _answer(self, script: Script, reader: Any, writer: Any, release: Any,
                      written: list[tuple[float, float]]) -> None:
        self.busy += 1
        try:
            await super()._answer(script, reader, writer, release, written)
        finally:
            self.busy -= 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    server = JudgeServer(port=args.port)
    print(server.base_url, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.close()


if __name__ == "__main__":
    main()
