"""Locust entry point for tokenload: streaming LLM users driven by a scenario file.

    locust -f locustfiles/llm.py --headless --scenario scenarios/smoke.toml --host http://127.0.0.1:8000/api

The channel comes from `--host` plus the usual environment/settings
(ANTHROPIC_*, OPENAI_*); the load shape, prompts and stop conditions from the
scenario. `tokenload run` uses this same file. Records land in `--run-dir`
(default results/<scenario>-<timestamp>) as requests.parquet + manifest.json.
"""

from tokenload.load import plugin  # noqa: F401  (registers the event listeners)
from tokenload.load.shapes import ScenarioShape
from tokenload.load.user import LLMUser

__all__ = ["LLMUser", "ScenarioShape"]
