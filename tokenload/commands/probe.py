"""Send one streaming request and watch it: the check users do by hand after configuring a channel.

The answer streams live to the terminal, then TTFT, TPOT, output tokens, total
latency and the formula line `TTFT + TPOT x N = predicted vs measured` are
printed. With `--server-metrics URL` (the server's Prometheus metrics) the
server is scraped before and after the request, and a last line says whether
the TTFT was spent in the server or added between you and it (a relay).
`--json` prints one JSON object with the request record's field names
(those of requests.parquet) instead. Exit 0 when the request succeeded, 1 with
the classified error, what it means and the fix (in doctor's words: the exact
base URL, a missing key and where to set it, a relay whose backend is down) when
it did not, 2 when the configuration could not be read.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from tokenload.channel import add_channel_arguments
from tokenload.record import RequestRecord

HELP = "one streaming request, tokens shown live, then TTFT, TPOT, total and the formula check"
DEFAULT_PROMPT = "Count from 1 to 30, one number per word, separated by spaces."


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text (default: a short counting task)")
    parser.add_argument("--max-tokens", type=int, default=64, help="maximum output tokens (default 64)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the request record's field names (those of requests.parquet)")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds to wait for the first token, and between tokens (default 60)")
    parser.add_argument("--server-metrics", action="append", metavar="URL",
                        help="the inference server's Prometheus metrics address (repeatable), scraped before and "
                             "after the request: what the server saw of it, and what was added in between")
    add_channel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from tokenload.channel import resolve_from_args
    from tokenload.doctor import explain_failure
    from tokenload.errors import ConfigError
    from tokenload.measure import formula
    from tokenload.transport.httpx_client import stream_exchange

    if args.max_tokens < 1:
        raise ConfigError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be positive, got {args.timeout:g}")
    resolution = resolve_from_args(args)
    channel = dataclasses.replace(resolution.channel, first_token_timeout_s=args.timeout, idle_timeout_s=args.timeout)
    err = Console(stderr=True)
    for warning in resolution.warnings:
        err.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    out = Console(highlight=False)

    def show(text: str, kind: str) -> None:
        # Model text is data, never rich markup: "[/x]" in an answer must print as is.
        out.print(text, end="", style="dim italic" if kind == "thinking" else None, soft_wrap=True, markup=False)

    if not args.json:
        out.print(f"[bold]{escape(str(channel))}[/]", soft_wrap=True)
        err.print(f"[dim]{escape(resolution.describe())}[/]", soft_wrap=True, highlight=False)
    bracket = None
    if args.server_metrics:
        from tokenload.servermetrics.single import Bracket
        from tokenload.workload.scenario import Scenario

        bracket = Bracket(Scenario.server_metrics_urls(args.server_metrics))
        bracket.scrape()
    record, timeline = stream_exchange(channel, args.prompt, args.max_tokens, on_text=None if args.json else show)
    server = None
    if bracket is not None:
        bracket.scrape()
        server = bracket.view(record["ttft_s"])
    check = formula(record["ttft_s"], record["tpot_s"], record["output_tokens"], record["e2e_s"])
    if args.json:
        print(json.dumps({**record, "formula": check, "channel": channel.public(),
                          **({"server": server} if server is not None else {})}, indent=2))
        return 0 if record["status"] == "ok" else 1
    out.print()
    if record["status"] != "ok":
        saw, fix = explain_failure(resolution, os.environ, record, timeline, args.timeout)
        err.print(f"[red]FAIL[/] {record['error_kind']}: {escape(saw)}", highlight=False, soft_wrap=True)
        if fix:
            err.print(f"fix: {fix}", highlight=False, markup=False, soft_wrap=True)
    _print_summary(out, record, check)
    if server is not None:
        out.print(f"server ({', '.join(server['servers']) or 'metrics'}): {server['note']}", soft_wrap=True,
                  markup=False)
    return 0 if record["status"] == "ok" else 1


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _print_summary(out: object, record: RequestRecord, check: dict | None) -> None:
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_row("connect (TCP+TLS)", _seconds(record["connect_s"]))
    table.add_row("TTFB", _seconds(record["ttfb_s"]))
    table.add_row("TTFT", _seconds(record["ttft_s"]))
    table.add_row("TPOT", _seconds(record["tpot_s"]) + ("/token" if record["tpot_s"] else ""))
    table.add_row("output tokens", f"{record['output_tokens']} ({record['output_tokens_source']})")
    table.add_row("input tokens", f"{record['input_tokens']} ({record['input_tokens_source']})")
    table.add_row("total (e2e)", _seconds(record["e2e_s"]))
    table.add_row("stop reason", str(record["stop_reason"]) + (" (only the end-of-sequence token)" if record["eos_only"] else ""))
    out.print(table)  # type: ignore[attr-defined]
    if check:
        n = record["output_tokens"]
        out.print(  # type: ignore[attr-defined]
            f"formula: TTFT + TPOT x N = {record['ttft_s']:.3f} + {record['tpot_s']:.4f} x {n} = "
            f"{check['predicted_simple_s']:.3f} s predicted vs {record['e2e_s']:.3f} s measured "
            f"({check['error_simple_pct']:+.1f}%; exact form with N-1: {check['error_exact_pct']:+.1f}%)",
            soft_wrap=True,  # one line, whatever the terminal width: scripts grep it
        )
    sys.stdout.flush()
