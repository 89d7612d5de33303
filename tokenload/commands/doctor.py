"""Diagnose a channel configuration the way an expert would: the seven common mistakes, in order.

One line per check: `ok`, `FAIL` with what it saw and the exact fix, or `skip`
when an earlier check it depends on failed (a broken channel is not hammered).
The order follows BRIEF.md's list of mistakes, except that "configuration not
read" (#7 there) comes first and the base URL (#2) comes before the key is
tried online (#1), because neither means anything until the earlier one holds:

  1 configuration   which source supplied each field; invalid JSON (line, column);
                    misspelt variable names; settings shadowed by the environment
  2 key hygiene     whitespace or newline in the key; placeholders; two different keys;
                    no key for a remote channel (offline; keys shown as fingerprints only)
  3 base URL        reachable (DNS, refused, TLS, timeout); HTML instead of an API;
                    404 with the variant that works (/api added, /v1 removed, path dropped);
                    redirects; plain http to a public host
  4 auth            401/403 from a one-token request, with the server's message
  5 model           unknown model id: the channel's models and the closest match
  6 latency         TTFT > --slo-ttft (then a short-prompt probe: prompt length or load?),
                    TPOT > --slo-tpot (a smaller model), TTFT + TPOT x --expected-output-tokens
                    > --slo-e2e (cap max tokens); the same SLO flags and defaults as run
                    and analyze (TPOT is not checked unless --slo-tpot is given)
  7 streaming       tokens arrive incrementally (not one burst from a buffering proxy)
                    and the stream ends with its final event
  8 rate limits     the limits the channel announced on the latency probe (values only);
                    one used up fails
  9 caching         two identical requests with a long new prefix: the second reads it from
                    the prompt cache (usage fields, else a TTFT drop); a relay may strip caching

`--json` prints the same as a list of objects {name, title, status, saw, fix, details}.
Exit 0 when every check passes, 1 when one fails, 2 when the configuration
could not be read at all.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tokenload.channel import add_channel_arguments, channel_flags
from tokenload.commands.slo_flags import add_slo_arguments, slo_from_args

HELP = ("check the seven common channel mistakes in order, then rate limits and prompt caching: ok, or FAIL "
        "with what was seen and the fix")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the checks as a JSON list of objects")
    parser.add_argument("--expected-output-tokens", type=int, default=256, metavar="N",
                        help="typical answer length of your application: --slo-e2e bounds an answer this long "
                             "(default 256)")
    parser.add_argument("--prompt-tokens", type=int, default=1000, metavar="N",
                        help="prompt length of the latency probe (default 1000)")
    parser.add_argument("--burst-ms", type=float, default=10.0, metavar="MS",
                        help="all tokens within this window after a wait = a buffering proxy (default 10)")
    parser.add_argument("--timeout", type=float, default=20.0, metavar="S",
                        help="seconds to wait for a connection, a response or the next token (default 20)")
    add_slo_arguments(parser)
    add_channel_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape

    from tokenload.doctor import FAIL, OK, Limits, diagnose_channel
    from tokenload.errors import ConfigError

    for flag in ("burst_ms", "timeout"):
        if getattr(args, flag) <= 0:
            raise ConfigError(f"--{flag.replace('_', '-')} must be positive, got {getattr(args, flag)}")
    for flag in ("expected_output_tokens", "prompt_tokens"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    slo = slo_from_args(args)
    limits = Limits(ttft_s=slo.ttft_s, tpot_s=slo.tpot_s, e2e_s=slo.e2e_s,
                    expected_output_tokens=args.expected_output_tokens, burst_s=args.burst_ms / 1000,
                    timeout_s=args.timeout, prompt_tokens=args.prompt_tokens)
    results, channel = diagnose_channel(flags=channel_flags(args), env=os.environ, cwd=Path.cwd(), home=Path.home(), limits=limits)

    if args.json:
        print(json.dumps([r.to_json() for r in results], indent=2))
    else:
        out = Console(highlight=False, soft_wrap=True)
        if channel is not None:
            out.print(f"[bold]tokenload doctor[/] {channel}")
        styles = {OK: ("green", "ok  "), FAIL: ("red", "FAIL")}
        for i, result in enumerate(results, 1):
            style, label = styles.get(result.status, ("dim", "skip"))
            fix = f"  [bold]fix:[/] {escape(result.fix)}" if result.fix else ""
            line = f"{i} [{style}]{label}[/] [bold]{result.title}[/]: {escape(result.saw)}{fix}"
            out.print(line, style="dim" if result.status not in styles else None)
    if channel is None:
        print(f"tokenload: error: {results[0].saw}", file=sys.stderr)
        return 2
    return 0 if all(r.status == OK for r in results) else 1
