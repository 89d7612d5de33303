"""Diagnose a channel configuration the way an expert would: the seven common mistakes, in order.

One line per check: `ok` only for what a successful request proved; `FAIL` with
what it saw and the exact fix; `????` ("could not verify", with the HTTP status
and the channel's message; status `unverified` in --json) when the channel
answered in a way that proves nothing either way (a 5xx, a timeout, a 429);
`note` for an informational finding; or `skip` when an earlier check it depends
on did not pass (a broken channel is not hammered). "Configuration
not read" (mistake 7 of the usual list) comes first and the base URL (2) before
the key is tried online (1), because neither means anything until the earlier one holds:

  1 configuration   which source supplied each field; invalid JSON (line, column);
                    misspelt variable names; settings shadowed by the environment
  2 key hygiene     whitespace or newline in the key; placeholders; two different keys;
                    no key for a remote channel (offline; keys shown as fingerprints only)
  3 base URL        reachable (DNS, refused, TLS, timeout); HTML instead of an API;
                    404 with the variant that works (/api added, /v1 removed, path dropped);
                    redirects; plain http to a public host
  4 auth            a one-token request: ok when it succeeded, FAIL on 401/403 with the
                    server's message; a relay whose backend is down, hung or refusing (5xx
                    naming an upstream connection, an error inside the stream, no answer while
                    its /v1/models or /health answers) is said as such, with who can fix it
  5 model           served when that request succeeded or the model list names it; unknown:
                    the channel's models and a close match when one is alike
  6 latency         TTFT, TPOT and an answer of --expected-output-tokens as TTFT + TPOT x N;
                    judged only when an SLO is given (--scenario's, or any --slo-* flag; the
                    SLO's defaults fill the rest, as on run and analyze): TTFT > --slo-ttft (then a
                    short-prompt probe: prompt length or load?), TPOT > --slo-tpot (a smaller
                    model), TTFT + TPOT x N > --slo-e2e (cap max tokens); no SLO given: the
                    numbers, never a FAIL
  7 streaming       tokens arrive incrementally (not one burst from a buffering proxy)
                    and the stream ends with its final event
  8 fidelity        (informational) the channel honours max_tokens, reports the stop reason
                    and usage truthfully, sends headers before the first token, serves the
                    model named
  9 rate limits     (informational) the limits the channel announced; a 429 or a limit used
                    up says when to retry (retry-after, retry-after-ms, llm_provider-retry-after,
                    the Anthropic and OpenAI reset headers)
 10 caching         (informational) two identical requests with a long new prefix: the second
                    reads it from the prompt cache; the prefix shrinks to a context limit the
                    channel names; a relay may strip caching

 11 server load     (informational, with --server-metrics URL) the server's own gauges, scraped
                    every half second while the checks ran: a server busy with other
                    traffic (more than one request running, any waiting, KV cache 90% full)
                    makes the latency above include its queue

`--json` prints the same as a list of objects {name, title, status, saw, fix, details, informational}.

Exit status: 1 when the channel cannot serve: a check you can fix failed
(configuration, key, base URL, protocol, auth, model, streaming, latency against
an SLO you gave), or doctor's request failed for good (a relay whose backend is
down or hung, a 5xx, no answer, a refusal). A rate limit or an overload (429,
529/503: busy now) and informational findings (fidelity, rate limits, caching,
shown as `note`) leave it at 0 unless --strict. 2 when the configuration cannot
be read at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tokenload.channel import add_channel_arguments, channel_flags
from tokenload.commands.slo_flags import add_slo_arguments, slo_from_args, slo_overrides
from tokenload.slo import Slo

HELP = ("check the seven common channel mistakes in order, then channel fidelity, rate limits and prompt caching: "
        "ok, FAIL with what was seen and the fix, or could not verify")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list of objects")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 also when a check could not be verified or an informational finding is not ok")
    parser.add_argument("--expected-output-tokens", type=int, default=256, metavar="N",
                        help="typical answer length of your application: the latency line totals an answer this "
                             "long (TTFT + TPOT x N) and --slo-e2e bounds it (default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, metavar="N",
                        help="prompt length of the latency probe (default 1000)")
    parser.add_argument("--burst-ms", type=float, default=10.0, metavar="MS",
                        help="all tokens within this window after a wait = a buffering proxy (default 10)")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="S",
                        help="seconds to wait for a connection, a response or the next token (default 20)")
    parser.add_argument("--server-metrics", action="append", metavar="URL",
                        help="the inference server's Prometheus metrics address (repeatable), scraped while the "
                             "checks run: whether the server itself was busy (running, waiting, KV cache)")
    parser.add_argument("--scenario", metavar="NAME|FILE",
                        help="judge latency against the SLO this scenario runs with (its [slo], else tokenload's "
                             "defaults), as `tokenload run` would; the --slo-* flags override its fields")
    add_slo_arguments(parser)
    add_channel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from tokenload.doctor import FAIL, OK, UNVERIFIED, Limits, check_server_load, diagnose_channel, exit_code
    from tokenload.errors import ConfigError

    for flag in ("burst_ms", "timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    for flag in ("expected_output_tokens", "prompt_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    # Judged only when the user gives an SLO (a scenario, or any --slo-* flag: the defaults then fill the rest, as
    # everywhere): a bound nobody asked for would fail a healthy channel.
    if args.scenario:
        from tokenload.workload.scenario import load_scenario

        slo: Slo | None = slo_from_args(args, load_scenario(args.scenario).slo)
    else:
        slo = slo_from_args(args) if slo_overrides(args) else None
    limits = Limits(ttft_s=slo.ttft_s if slo else None, tpot_s=slo.tpot_s if slo else None,
                    e2e_s=slo.e2e_s if slo else None,
                    expected_output_tokens=args.expected_output_tokens, burst_s=args.burst_ms / 1000,
                    timeout_s=args.timeout, prompt_tokens=args.prompt_tokens)
    sampler = None
    if args.server_metrics:  # checked before any request: a URL that is no Prometheus text is exit 2
        from tokenload.servermetrics import scrape
        from tokenload.workload.scenario import Scenario

        sources = scrape.resolve(Scenario.server_metrics_urls(args.server_metrics), "", interval_s=0.5)
        sampler = scrape.Sampler(sources, keep_gauges=True).start()
    try:
        results, channel = diagnose_channel(flags=channel_flags(args), env=os.environ, cwd=Path.cwd(),
                                            home=Path.home(), limits=limits)
    finally:
        if sampler is not None:
            sampler.stop()
    if sampler is not None and channel is not None:
        results.append(check_server_load(sampler.history, sampler.sources.found, sampler.last_problem))

    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        out = Console(highlight=False, soft_wrap=True)
        if channel is not None:
            out.print(f"[bold]tokenload doctor[/] {channel}")
        styles = {OK: ("green", "ok  "), FAIL: ("red", "FAIL"), UNVERIFIED: ("yellow", "????")}
        for i, result in enumerate(results, 1):
            style, label = styles.get(result.status, ("dim", "skip"))
            if result.status == FAIL and result.informational:
                style, label = "yellow", "note"
            fix = f"  [bold]fix:[/] {escape(result.fix)}" if result.fix else ""
            line = f"{i} [{style}]{label}[/] [bold]{result.title}[/]: {escape(result.saw)}{fix}"
            out.print(line, style="dim" if result.status not in styles else None)
    if channel is None:
        print(f"tokenload: error: {results[0].saw}", file=sys.stderr)
        return 2
    return exit_code(results, strict=args.strict)
