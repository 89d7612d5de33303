"""Analysis of a run's request records: fits, formula test, breakpoint, diagnosis, report.

Public entry points (what the CLI commands and `tokenload demo` call):

- `analyze_run(run_dir, slo=None, slo_overrides=None, ...) -> dict`: writes summary.json,
  plots/*.png and report.html into the run dir and returns the summary (the SLO: `slo`, else the
  run's scenario `[slo]` with `slo_overrides` applied).
- `compare_runs(run_dirs, labels=None, out_dir=None, ...) -> dict`: writes comparison.json,
  comparison.html and plots, returns the comparison.
- `verdict_table(summary) -> rich.table.Table` / `print_verdict(summary, console)`.

Imported lazily so `import tokenload.analysis` does not pull in pandas or matplotlib.
"""

from __future__ import annotations

from typing import Any

__all__ = ["analyze_run", "compare_runs", "print_verdict", "verdict_table", "comparison_table"]

_WHERE = {
    "analyze_run": "tokenload.analysis.pipeline",
    "print_verdict": "tokenload.analysis.pipeline",
    "verdict_table": "tokenload.analysis.report",
    "compare_runs": "tokenload.analysis.compare",
    "comparison_table": "tokenload.analysis.compare",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
