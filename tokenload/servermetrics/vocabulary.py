"""One vocabulary for every inference server's Prometheus names.

vLLM, SGLang, llama.cpp and TGI publish the same few facts under different
names: how many requests run in the batch, how many wait, how full the KV cache
is, and histograms of queue time and TTFT. The analysis speaks only tokenload's
terms (`TERMS`); `NAMES` says which server sample means which term. A name not
listed here is kept raw in server_metrics.parquet and simply not interpreted.
docs/server-metrics.md shows the same table for readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["gauge", "counter", "histogram"]


@dataclass(frozen=True)
class Term:
    """One of tokenload's server-side quantities."""

    kind: Kind
    how: Literal["sum", "mean"]  # several series (models, servers) of one term at one time: added, or averaged
    meaning: str


TERMS: dict[str, Term] = {
    "running": Term("gauge", "sum", "requests in the running batch (holding a batch slot)"),
    "waiting": Term("gauge", "sum", "requests queued for a batch slot"),
    "kv_cache_usage": Term("gauge", "mean", "share of the KV cache in use, 0 to 1"),
    "server_ttft": Term("histogram", "sum", "time to first token as the server measured it, seconds"),
    "queue_time": Term("histogram", "sum", "time a request waited before it was scheduled, seconds"),
    "prefill_time": Term("histogram", "sum", "time a request spent in prefill, seconds"),
    "decode_time": Term("histogram", "sum", "time a request spent in decode, seconds"),
    "prompt_tokens": Term("counter", "sum", "prompt (prefill) tokens processed"),
    "prefill_seconds": Term("counter", "sum", "seconds spent in prefill, summed over the requests"),
    "generation_tokens": Term("counter", "sum", "tokens generated"),
    "preemptions": Term("counter", "sum", "requests preempted (evicted from the KV cache to be recomputed)"),
}

# Server sample name -> (term, server). Histograms are listed by their family name (the samples are
# NAME_bucket, NAME_sum and NAME_count); gauges and counters by the sample name itself.
NAMES: dict[str, tuple[str, str]] = {
    "vllm:num_requests_running": ("running", "vLLM"),
    "vllm:num_requests_waiting": ("waiting", "vLLM"),
    "vllm:kv_cache_usage_perc": ("kv_cache_usage", "vLLM"),
    "vllm:gpu_cache_usage_perc": ("kv_cache_usage", "vLLM (before 0.10)"),
    "vllm:time_to_first_token_seconds": ("server_ttft", "vLLM"),
    "vllm:request_queue_time_seconds": ("queue_time", "vLLM"),
    "vllm:request_prefill_time_seconds": ("prefill_time", "vLLM"),
    "vllm:request_decode_time_seconds": ("decode_time", "vLLM"),
    "vllm:prompt_tokens_total": ("prompt_tokens", "vLLM"),
    "vllm:generation_tokens_total": ("generation_tokens", "vLLM"),
    "vllm:num_preemptions_total": ("preemptions", "vLLM"),
    "sglang:num_running_reqs": ("running", "SGLang"),
    "sglang:num_queue_reqs": ("waiting", "SGLang"),
    "sglang:token_usage": ("kv_cache_usage", "SGLang"),
    "sglang:time_to_first_token_seconds": ("server_ttft", "SGLang"),
    "sglang:queue_time_seconds": ("queue_time", "SGLang"),
    "sglang:prompt_tokens_total": ("prompt_tokens", "SGLang"),
    "sglang:generation_tokens_total": ("generation_tokens", "SGLang"),
    "llamacpp:requests_processing": ("running", "llama.cpp"),
    "llamacpp:requests_deferred": ("waiting", "llama.cpp"),
    "llamacpp:kv_cache_usage_ratio": ("kv_cache_usage", "llama.cpp"),
    "llamacpp:prompt_tokens_total": ("prompt_tokens", "llama.cpp"),
    "llamacpp:prompt_seconds_total": ("prefill_seconds", "llama.cpp"),
    "llamacpp:tokens_predicted_total": ("generation_tokens", "llama.cpp"),
    "tgi_batch_current_size": ("running", "TGI"),
    "tgi_queue_size": ("waiting", "TGI"),
    "tgi_request_queue_duration": ("queue_time", "TGI"),
    # TGI has no token counters; the sums of its per-request length histograms count the same tokens.
    "tgi_request_input_length_sum": ("prompt_tokens", "TGI"),
    "tgi_request_generated_tokens_sum": ("generation_tokens", "TGI"),
}

Part = Literal["value", "bucket", "count", "sum"]
_SUFFIXES: tuple[tuple[str, Part], ...] = (("_bucket", "bucket"), ("_count", "count"), ("_sum", "sum"))


def lookup(sample: str) -> tuple[str, Part] | None:
    """The term a sample belongs to and which part of it it is; None for a sample outside the vocabulary.

    A histogram's percentiles come from its buckets, its mean from its `_sum` over
    its `_count` (a `_sum` the table lists as a counter of its own stays one: TGI).
    """
    hit = NAMES.get(sample)
    if hit is not None and TERMS[hit[0]].kind != "histogram":
        return hit[0], "value"
    for suffix, part in _SUFFIXES:
        if sample.endswith(suffix):
            hit = NAMES.get(sample[: -len(suffix)])
            if hit is not None and TERMS[hit[0]].kind == "histogram":
                return hit[0], part
    return None


def servers(samples: set[str] | list[str]) -> list[str]:
    """Which servers' names appear among `samples` ("vLLM", "llama.cpp", ...), for the manifest and report."""
    found: set[str] = set()
    for sample in samples:
        term = lookup(sample)
        if term is not None:
            base = sample if term[1] == "value" else sample.rsplit("_", 1)[0]
            found.add(NAMES[base][1].split(" (")[0])
    return sorted(found)
