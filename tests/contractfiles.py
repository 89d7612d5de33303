"""Every summary.json and manifest.json the suite wrote, validated against the JSON Schemas the package ships.

tests/conftest.py calls `check` once at the end of the session, in the process that owns the session's
temporary directory (under pytest-xdist the controller: the workers' directories are below its own), so a
file written by any test, fixture or child process (`tokenload run --out`, `tokenload analyze`) is judged.
A manifest.json without `schema_version` is an input a test wrote by hand to stand for a run of an older
version (`tokenload.analysis.records.write_run`); it is counted, not judged.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from jsonschema import Draft202012Validator

from tokenload.contracts.schemas import shipped

SCHEMA_OF = {"summary.json": "summary.schema.json", "manifest.json": "manifest.schema.json"}
SHOWN_ERRORS = 3  # per file


def check(root: Path) -> tuple[Counter[str], list[str]]:
    """(files judged per name, with `older manifest.json` for the inputs skipped; one line per problem)."""
    counts: Counter[str] = Counter()
    problems: list[str] = []
    for name, schema in SCHEMA_OF.items():
        validator = Draft202012Validator(shipped(schema))
        for path in sorted(root.rglob(name)):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                problems.append(f"{path}: not readable JSON ({exc})")
                continue
            if name == "manifest.json" and isinstance(data, dict) and "schema_version" not in data:
                counts["older manifest.json"] += 1
                continue
            counts[name] += 1
            errors = sorted(validator.iter_errors(data), key=lambda e: list(e.absolute_path))
            problems += [f"{path}: {'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:300]}"
                         for e in errors[:SHOWN_ERRORS]]
    return counts, problems
