"""An inference server in miniature for tests: N batch slots, a FIFO queue, vLLM-style /metrics.

Independent of the simulator: it schedules each request on arrival on the slot
that frees first (a request that finds every slot busy waits), answers with a
scripted Anthropic stream whose first token comes after the wait plus a fixed
prefill, and publishes `vllm:num_requests_running` / `vllm:num_requests_waiting`
and queue-time / TTFT histograms computed from that same schedule at scrape
time. Tests thus know the server's truth exactly: min(users, slots) running and
max(users - slots, 0) waiting under a closed loop. With `relay_slots`, a relay in
front queues what exceeds its connections before the server sees it.
"""

from __future__ import annotations

import bisect
import threading
import time
from dataclasses import dataclass, field

from fakeserver import FakeServer, Received, Script, anthropic_stream, body_script

BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Job:
    arrival: float
    start: float
    end: float
    first_token: float


@dataclass
class GaugeServer:
    fake: FakeServer
    slots: int = 4
    prefill_s: float = 0.05
    tokens: int = 8
    per_token_s: float = 0.03
    # A relay in front with this many connections to the server (0: none): requests beyond them wait in the
    # relay, a time the server's own metrics never see.
    relay_slots: int = 0
    # A relay in front that adds this long before the server sees a request (its TTFT and queue never show it).
    relay_delay_s: float = 0.0
    # KV-cache share each running request holds (0: no `vllm:kv_cache_usage_perc` published)
    kv_per_request: float = 0.0
    jobs: list[Job] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._free_at = [0.0] * self.slots
        self._relay_free_at = [0.0] * self.relay_slots
        self._lock = threading.Lock()
        self.fake.route(self.answer)

    @property
    def url(self) -> str:
        return self.fake.url

    def answer(self, received: Received) -> Script:
        if received.path == "/metrics":
            return body_script(200, self.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
        now = time.time()
        with self._lock:
            arrival, link = now + self.relay_delay_s, -1
            if self.relay_slots:
                link = min(range(self.relay_slots), key=self._relay_free_at.__getitem__)
                arrival = max(arrival, self._relay_free_at[link])
            slot = min(range(self.slots), key=self._free_at.__getitem__)
            start = max(arrival, self._free_at[slot])
            first = start + self.prefill_s
            end = first + (self.tokens - 1) * self.per_token_s
            self._free_at[slot] = end
            if link >= 0:
                self._relay_free_at[link] = end
            self.jobs.append(Job(arrival, start, end, first))
        return Script(writes=anthropic_stream(["tok "] * self.tokens, first - now, self.per_token_s,
                                              output_tokens=self.tokens))

    def state(self, t: float) -> tuple[int, int]:
        """(running, waiting) at time t by the schedule."""
        with self._lock:
            jobs = list(self.jobs)
        return (sum(j.start <= t < j.end for j in jobs), sum(j.arrival <= t < j.start for j in jobs))

    def mean_state(self, a: float, b: float) -> tuple[float, float]:
        """(running, waiting) averaged over the time [a, b) by the schedule (an integral, not samples)."""
        with self._lock:
            jobs = list(self.jobs)

        def share(lo: float, hi: float) -> float:
            return max(0.0, min(hi, b) - max(lo, a)) / (b - a)

        return sum(share(j.start, j.end) for j in jobs), sum(share(j.arrival, j.start) for j in jobs)

    def metrics_text(self) -> str:
        now = time.time()
        running, waiting = self.state(now)
        with self._lock:
            seen = [j for j in self.jobs if j.first_token <= now]
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
                 "# TYPE vllm:num_requests_running gauge",
                 f'vllm:num_requests_running{{model_name="slot-4"}} {running}',
                 "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
                 "# TYPE vllm:num_requests_waiting gauge",
                 f'vllm:num_requests_waiting{{model_name="slot-4"}} {waiting}']
        if self.kv_per_request:
            lines += ["# TYPE vllm:kv_cache_usage_perc gauge",
                      f'vllm:kv_cache_usage_perc{{model_name="slot-4"}} {running * self.kv_per_request}']
        for name, values in (("vllm:request_queue_time_seconds", [j.start - j.arrival for j in seen]),
                             ("vllm:time_to_first_token_seconds", [j.first_token - j.arrival for j in seen])):
            lines += [f"# HELP {name} histogram", f"# TYPE {name} histogram"]
            ordered = sorted(values)
            for bound in BUCKETS:
                lines.append(f'{name}_bucket{{le="{bound:g}",model_name="slot-4"}} {bisect.bisect_right(ordered, bound)}')
            lines.append(f'{name}_bucket{{le="+Inf",model_name="slot-4"}} {len(values)}')
            lines.append(f'{name}_sum{{model_name="slot-4"}} {sum(values)}')
            lines.append(f'{name}_count{{model_name="slot-4"}} {len(values)}')
        lines += ["# TYPE python_gc_objects_collected counter", 'python_gc_objects_collected_total{generation="0"} 7']
        return "\n".join(lines) + "\n"
