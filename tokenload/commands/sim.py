"""Run the built-in channel simulator in the foreground.

The first stdout line is the base URL (prefix included), e.g.
http://127.0.0.1:43123/api: point ANTHROPIC_BASE_URL at it, or OPENAI_BASE_URL
at it plus /v1. Logs go to stderr; SIGINT or SIGTERM stops it cleanly.
Examples:
  tokenload sim --profile fast --port 0 --truth truth.jsonl
  tokenload sim --profile peak --api-key sk-test --model sim-7b --model sim-70b
  tokenload sim --profile diurnal --time-scale 360   # a day (off-peak 01-06, peak 13-17) in 4 minutes

"""

from __future__ import annotations

import argparse

import tokenload.sim

__doc__ = (__doc__ or "") + (tokenload.sim.__doc__ or "")

HELP = "run the built-in channel simulator (Anthropic + OpenAI streaming, known behaviour under load)"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    parser.add_argument("--profile", default="default", metavar="NAME|FILE",
                        help=f"built-in profile ({', '.join(tokenload.sim.builtin_profiles())}) or a TOML file")
    parser.add_argument("--api-key", metavar="K", help="require this key (x-api-key or Authorization: Bearer)")
    parser.add_argument("--model", action="append", metavar="M",
                        help="serve this model id; repeat for several (replaces the profile's list)")
    parser.add_argument("--truth", metavar="FILE", help="write one JSON line of server-side truth per request")
    parser.add_argument("--prefix", default="/api", help="path prefix of the API (default /api; '' for none)")
    parser.add_argument("--time-scale", type=float, metavar="N",
                        help="run the simulated day N times faster (a `load_by_hour` profile such as diurnal): "
                             "360 = a day in 4 minutes; give watch and history --period 86400/N seconds")
    parser.add_argument("--day-phase", type=float, metavar="H", help="hours added to the simulated clock (0-24)")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="processes sharing the port via SO_REUSEPORT (each runs its own model copy)")


def run(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    from tokenload.errors import ConfigError
    from tokenload.sim.profile import with_overrides
    from tokenload.sim.runner import serve_foreground

    if args.workers < 1:
        raise ConfigError("--workers must be at least 1")
    profile = tokenload.sim.load_profile(args.profile)
    day = {k: v for k, v in (("time_scale", args.time_scale), ("day_phase_h", args.day_phase)) if v is not None}
    if day:
        profile = with_overrides(profile, "command line", **day)
    if args.truth and not Path(args.truth).resolve().parent.is_dir():
        raise ConfigError(f"--truth {args.truth}: its directory does not exist; create it or pick another path")
    models = args.model or profile.models
    day_note = f" x the hour's factor, a day lasting {86400 / profile.time_scale:g} s" if profile.load_by_hour else ""
    print(f"tokenload sim: profile {args.profile}, models {', '.join(models)}, slots {profile.slots}"
          f" x {profile.replicas} replica(s), load {profile.load}{day_note}, auth {'on' if args.api_key else 'off'}",
          file=sys.stderr)
    try:
        return serve_foreground(profile, host=args.host, port=args.port, api_key=args.api_key, models=args.model,
                                truth_path=Path(args.truth) if args.truth else None, prefix=args.prefix,
                                workers=args.workers)
    except OSError as exc:
        raise ConfigError(f"cannot serve on {args.host}:{args.port}: {exc.strerror}") from None
