"""The server's view of one request (`tokenload probe --server-metrics URL`): a scrape before it, one after.

Gauges come from the scrape before the request (what it found on arrival); the
server's TTFT and queue time for it come from the histogram buckets that grew
in between, so they are a bucket, [lower, upper], not a number. With the
client's TTFT beside it this says, for a single request, whether the time was
spent in the server or between the client and the server.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pandas as pd

from tokenload.errors import ConfigError
from tokenload.servermetrics import scrape, series
from tokenload.servermetrics.vocabulary import servers


class Bracket:
    """Scrape `urls` before and after one request and say what the server saw of it."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self._frames: list[pd.DataFrame] = []
        self._gauges: dict[str, float] = {}
        self.found: list[str] = []

    def scrape(self) -> None:
        """One scrape of every URL; the first one refuses a URL that is not Prometheus text (ConfigError)."""
        first = not self._frames
        rows: list[tuple[float, str, str, str, float]] = []
        with scrape.client() as http:
            for url in self.urls:
                at = time.time()
                try:
                    got = scrape.scrape(http, url)
                except ValueError as exc:
                    if first:
                        raise ConfigError(f"server metrics: {exc}; give the server's Prometheus /metrics address "
                                          "or leave --server-metrics out") from None
                    continue
                if first:
                    self._gauges.update(scrape.gauges(got))
                    self.found = sorted(set(self.found) | set(servers({n for n, _, _ in got})))
                rows += [(at, scrape.public_url(url), name, labels, value) for name, labels, value in got]
        self._frames.append(pd.DataFrame(rows, columns=["time", "source", "name", "labels", "value"]))

    def view(self, client_ttft_s: float | None) -> dict[str, Any]:
        """What the server reported about the request between the two scrapes, and one sentence on it."""
        df = series.mapped(pd.concat(self._frames, ignore_index=True))
        start, end = float(self._frames[0]["time"].max()), float(self._frames[-1]["time"].max())
        out: dict[str, Any] = {"servers": self.found, **{f"{k}_before": v for k, v in sorted(self._gauges.items())}}
        for term in ("server_ttft", "queue_time"):
            got = series.window_quantile(df, term, start, end, 0.5)
            if got is not None:
                out[f"{term}_bucket_s"] = [got.lower, None if got.upper == float("inf") else got.upper]
        upper = (out.get("server_ttft_bucket_s") or [None, None])[1]
        if client_ttft_s is None or upper is None:
            out["note"] = "the server reported no TTFT for this request" if upper is None else None
        elif client_ttft_s > upper:
            out["note"] = (f"the server's TTFT was at most {upper:g} s of the client's {client_ttft_s:.3g} s: at least "
                           f"{client_ttft_s - upper:.3g} s were added between you and the server")
        else:
            out["note"] = (f"the client's TTFT {client_ttft_s:.3g} s is within the server's own "
                           f"({out['server_ttft_bucket_s'][0]:g}-{upper:g} s): the time was spent in the server")
        return out
