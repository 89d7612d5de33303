"""The built-in channel simulator: a streaming LLM endpoint whose behaviour under load is known.

It serves, under a path prefix (default `/api`): `POST /v1/messages` (also
`?beta=true`), `POST /v1/messages/count_tokens`, `POST /v1/chat/completions`,
`POST /v1/responses`, `GET /v1/models`, `GET /health` and `GET /metrics`
(Prometheus text with vLLM's metric names; also at the root, `/metrics`,
where vLLM serves it). Any other path or method gets an
HTML page (200 for `/` and the prefix root, 404 elsewhere), as a wrong base URL
does in real life. With an API key set, `x-api-key: K` or `Authorization:
Bearer K` is required (401 with the protocol's body otherwise); an unknown model
gets 404 naming it.

Behaviour model (all times scale with model size and `load`):
  * Continuous batching: each replica decodes up to `slots` sequences; more
    requests wait in a FIFO queue, and the wait is part of TTFT.
  * Prefill of n input tokens takes `prefill_base_s + prefill_per_token_s * n^prefill_exponent`
    (exponent 1 = linear, < 1 = sub-linear); prefills on a replica run one
    after another, and while one runs, that replica's decode steps are
    `prefill_interference` slower. The first token is written when prefill ends.
  * Every decode step emits one token per active sequence and lasts
    `decode_base_s + decode_per_seq_s * (active - 1)`: TPOT rises with batch size.
  * Model size: time x (size / 7B)^model_size_exponent, size read from the model
    id (`sim-30b` is about 2.5x `sim-7b`).
  * `load` > 1 models other tenants: slower prefill and decode, fewer slots.
    `load_by_hour` makes it follow a local day (profile `diurnal`), which
    `time_scale` compresses (`--time-scale N`: a day in 24 h / N).
  * Output = max_tokens, or an early stop drawn from the eos distribution
    (`ignore_eos` disables it, `min_tokens` bounds it); thinking tokens (Anthropic
    thinking blocks, OpenAI `reasoning_content` / Responses reasoning text) come
    first and count as output. Input tokens are `tokenload.tokens.estimate_tokens`
    of all prompt text; output text is one word per token.
  * Prompt caching: each model keeps an LRU prefix cache (`prefix_cache_tokens`,
    16-token blocks); tokens read from it skip prefill. Anthropic requests cache
    up to their last `cache_control` breakpoint only, OpenAI ones automatically;
    usage reports them as `cache_read_input_tokens` / `cache_creation_input_tokens`
    (Anthropic) or `prompt_tokens_details` / `input_tokens_details.cached_tokens`.
  * Rate limits (rpm, tpm, concurrency) answer 429 + retry-after + the protocol's body;
    with rpm or tpm set, every admitted response carries the vendor's rate-limit headers
    (`anthropic-ratelimit-*` on /v1/messages, `x-ratelimit-*` on the OpenAI routes).
  * Faults by profile rate or by prompt marker; every request gets a truth line.

Fault markers: put `[[fault:KIND key=value ...]]` anywhere in the prompt text
(several may combine; one of the stream-ending kinds at most). In a profile,
`[faults]` maps the same `KIND key=value` text to a probability per streaming
request. Kinds (N/2 = half the planned output):
{faults}

Truth file (`--truth FILE`): one JSON line per request, flushed as written, with
request_id (also the `x-request-id` / `request-id` response headers), path,
protocol, model, status, arrival, admitted, first_token, last_token (unix
seconds), input_tokens, cached_tokens and cache_creation_tokens (of the input,
read from and written to the prefix cache), output_tokens (tokens actually written),
planned_output_tokens, thinking_tokens, max_tokens, model_size_b (the size the
model id names, null without one) and model_scale (its time factor, (size / 7B) ^
model_size_exponent), stream, fault, queue_s,
replica, outcome (ok, client_closed, disconnect, reset, error_event,
no_final_chunk) and error (the error kind of an early answer).

Profile knobs (TOML keys; built-in profiles: default, fast, offpeak, peak,
ratelimited, diurnal, nocache; `extends = "NAME"` inherits):
{knobs}
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenload.sim.faults import describe_kinds
from tokenload.sim.profile import Profile, builtin_profiles, knobs_help, load_profile

__doc__ = __doc__.replace("{faults}", describe_kinds()).replace("{knobs}", knobs_help())

if TYPE_CHECKING:
    from tokenload.sim.runner import SimHandle, SimProcess, launch, serve_in_thread
    from tokenload.sim.server import SimServer

__all__ = ["Profile", "SimHandle", "SimProcess", "SimServer", "builtin_profiles", "launch", "load_profile",
           "serve_in_thread"]
_LAZY = {"SimServer": "tokenload.sim.server", "SimHandle": "tokenload.sim.runner", "SimProcess": "tokenload.sim.runner",
         "launch": "tokenload.sim.runner", "serve_in_thread": "tokenload.sim.runner"}


def __getattr__(name: str) -> Any:
    """The server side loads asyncio; keep `tokenload sim --help` and profile checks light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
