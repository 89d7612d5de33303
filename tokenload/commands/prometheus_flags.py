"""The `--prometheus-port` / `--prometheus-host` flags, defined once for run and watch.

The exporter (`tokenload.exporter.LiveMetrics`) listens before any request is
sent, so a port in use is one line and exit code 2 with nothing loaded; at the
end the final numbers stay up until one more scrape reads them (at most
`LINGER_S`), so a Prometheus scraping every 15 s sees how a short run ended.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from tokenload.exporter import LiveMetrics

# After the run, the final numbers stay up until one more scrape reads them, at most this long: a
# Prometheus scraping every 15 s (its default) still sees the end of a run that exits right after.
LINGER_S: Final = 30.0
DEFAULT_HOST: Final = "127.0.0.1"


def add_prometheus_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """The two flags; `what` says whose records the metrics count."""
    parser.add_argument("--prometheus-port", type=int, metavar="N",
                        help=f"serve live Prometheus metrics of {what} on http://ADDR:N/metrics "
                             "(tokenload_ttft_seconds, tokenload_requests_total, ...; see docs/deploy.md); at the "
                             f"end they stay up until scraped once more, at most {LINGER_S:g} s; a port in use is one line and "
                             "exit 2 before any load")
    parser.add_argument("--prometheus-host", default=DEFAULT_HOST, metavar="ADDR",
                        help=f"--prometheus-port: interface to listen on (default {DEFAULT_HOST}; 0.0.0.0 in a "
                             "container)")


def serve_from_args(args: argparse.Namespace, run_id: str = "") -> LiveMetrics | None:
    """The exporter, listening, or None without `--prometheus-port`; a port in use is a ConfigError."""
    if args.prometheus_port is None:
        return None
    from tokenload.errors import ConfigError
    from tokenload.exporter import LiveMetrics

    if not 0 < args.prometheus_port < 65536:
        raise ConfigError(f"--prometheus-port must be a TCP port (1-65535), got {args.prometheus_port}")
    return LiveMetrics(run_id).serve(args.prometheus_host, args.prometheus_port)


def linger(metrics: LiveMetrics | None) -> None:
    """After the last record: wait for one more scrape, at most `LINGER_S` (the caller closes the exporter)."""
    if metrics is None:
        return
    print(f"tokenload: final metrics on port {metrics.port} until scraped once more (at most {LINGER_S:g} s; "
          "Ctrl-C ends it)", file=sys.stderr, flush=True)
    try:
        metrics.linger(LINGER_S)
    except KeyboardInterrupt:
        pass
