"""The server's side of a run: scrape its Prometheus `/metrics` while the load runs, in one vocabulary.

`scrape` fetches and parses the exposition text (prometheus_client's parser) and
`Sampler` samples it once a second in a thread of the supervising process, never
in a Locust process, so the load path does not pay for it; the raw samples go to
RUN_DIR/server_metrics.parquet. `vocabulary` maps vLLM, SGLang, llama.cpp and
TGI names onto tokenload's (`running`, `waiting`, `kv_cache_usage`,
`server_ttft`, ...), and `series` turns raw samples into per-window numbers:
gauge means, counter rates, histogram percentiles from bucket deltas.
"""
