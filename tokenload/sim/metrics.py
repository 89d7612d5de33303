"""Prometheus text exposition under vLLM's metric names, so dashboards built for vLLM read the simulator."""

from __future__ import annotations

from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable

from tokenload.sim.engine import LATENESS_BUCKET_S, LATENESS_BUCKETS, Stats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds.",
    "vllm:e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
}


class Histogram:
    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, weight: int = 1) -> None:
        self.counts[bisect_left(_LATENCY_BUCKETS, value)] += weight
        self.sum += value * weight
        self.count += weight


class Metrics:
    """Per-model histograms and counters; gauges are read from the engines at scrape time."""

    def __init__(self) -> None:
        self.histograms: dict[str, dict[str, Histogram]] = {name: defaultdict(Histogram) for name in _HISTOGRAMS}
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.generation_tokens: dict[str, int] = defaultdict(int)
        self.requests: dict[tuple[str, str], int] = defaultdict(int)

    def observe(self, name: str, model: str, value: float, weight: int = 1) -> None:
        self.histograms[name][model].observe(value, weight)

    def itl_observer(self, model: str) -> Callable[[float, int], None]:
        histogram = self.histograms["vllm:inter_token_latency_seconds"][model]
        return lambda seconds, count: histogram.observe(seconds, count) if count else None

    def render(self, gauges: dict[str, tuple[int, int]], stats: Stats) -> str:
        """`gauges` maps model -> (running, waiting)."""
        out: list[str] = []

        def family(name: str, kind: str, help_text: str) -> None:
            out.append(f"# HELP {name} {help_text}")
            out.append(f"# TYPE {name} {kind}")

        family("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.")
        out += [f'vllm:num_requests_running{{model_name="{m}"}} {r}' for m, (r, _) in gauges.items()]
        family("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.")
        out += [f'vllm:num_requests_waiting{{model_name="{m}"}} {w}' for m, (_, w) in gauges.items()]
        family("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.")
        out += [f'vllm:prompt_tokens_total{{model_name="{m}"}} {n}' for m, n in self.prompt_tokens.items()]
        family("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.")
        out += [f'vllm:generation_tokens_total{{model_name="{m}"}} {n}' for m, n in self.generation_tokens.items()]
        family("vllm:request_success_total", "counter", "Count of finished requests by outcome.")
        out += [f'vllm:request_success_total{{model_name="{m}",finished_reason="{r}"}} {n}'
                for (m, r), n in self.requests.items()]
        for name, help_text in _HISTOGRAMS.items():
            family(name, "histogram", help_text)
            for model, hist in self.histograms[name].items():
                out += _histogram_lines(name, f'model_name="{model}"', _LATENCY_BUCKETS, hist.counts, hist.sum, hist.count)
        family("sim_token_write_lateness_seconds", "histogram",
               "How late each token was written against the simulated schedule (simulator health).")
        bounds = tuple((i + 1) * LATENESS_BUCKET_S for i in range(LATENESS_BUCKETS))
        total = sum(stats.lateness)
        out += _histogram_lines("sim_token_write_lateness_seconds", "", bounds, stats.lateness, None, total, sparse=True)
        family("sim_tokens_total", "counter", "Tokens written by the scheduler.")
        out.append(f"sim_tokens_total {stats.tokens}")
        family("sim_step_busy_seconds_total", "counter", "CPU time spent inside decode steps.")
        out.append(f"sim_step_busy_seconds_total {stats.step_seconds:.6f}")
        return "\n".join(out) + "\n"


def _histogram_lines(name: str, labels: str, bounds: tuple[float, ...], counts: list[int],
                     total_sum: float | None, count: int, sparse: bool = False) -> list[str]:
    """Cumulative buckets; `sparse` skips buckets that add nothing (the 1000-bucket lateness histogram)."""
    prefix = labels + "," if labels else ""
    suffix = "{" + labels + "}" if labels else ""
    lines, cumulative = [], 0
    for bound, n in zip(bounds, counts):
        cumulative += n
        if n or not sparse:
            lines.append(f'{name}_bucket{{{prefix}le="{bound:g}"}} {cumulative}')
    lines.append(f'{name}_bucket{{{prefix}le="+Inf"}} {count}')
    if total_sum is not None:
        lines.append(f"{name}_sum{suffix} {total_sum:.6f}")
    lines.append(f"{name}_count{suffix} {count}")
    return lines
