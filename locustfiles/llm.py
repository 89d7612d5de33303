"""Locust entry point for tokenload: streaming LLM users driven by a scenario file.

    locust -f locustfiles/llm.py --scenario smoke --host http://127.0.0.1:8000/api             # web UI
    locust -f locustfiles/llm.py --headless --scenario scenarios/smoke.toml --host ... --csv out

The channel comes from `--host` plus the usual environment/settings
(ANTHROPIC_*, OPENAI_*); the load shape, prompts and stop conditions from the
scenario. `tokenload run` uses this same file.

tokenload's options (Locust prints `--help` before it loads a locustfile, so
they are not in that list; each also reads the environment variable shown):

  --scenario FILE|NAME  scenario .toml or a packaged name: demo, smoke, ramp, ...
                        (TOKENLOAD_SCENARIO; default smoke)
  --run-dir DIR         run directory for the records (TOKENLOAD_RUN_DIR;
                        default results/<scenario>-<timestamp>); on a worker
                        that does not see the master's, its spool of records
                        not yet acknowledged (default a temporary directory)
  --run-id ID           run id stored in every record (TOKENLOAD_RUN_ID; default: a new one)

Locust's statistics count one request per LLM request (the "POST" row: RPS and
failures are real requests). TTFT, TPOT, ITL, e2e percentiles, tokens/s and
error kinds per load step are in the web UI's "tokenload" tab (with charts over
time and a link to each finished run's report.html), in "Download data", and
with `--csv PREFIX` in PREFIX_tokenload.csv. With the web UI every start is a
run directory of its own (DIR, DIR-2, ...), finalised and analysed when it
stops. Records land in the run directory as requests.parquet + manifest.json.
"""

from tokenload.load import plugin  # noqa: F401  (registers the event listeners)
from tokenload.load.shapes import ScenarioShape
from tokenload.load.user import LLMUser
from tokenload.webui import tab  # noqa: F401  (adds the tokenload tab and the --csv token statistics)

__all__ = ["LLMUser", "ScenarioShape"]
