"""The typed hand-offs between stages: what `manifest.json` and `summary.json` hold, defined once.

- `manifest`: `Manifest`, what `tokenload run` writes beside the records (and `StopRecord`, the live rule
  that ended a run, by name and fields beside its sentence);
- `summary`: `Summary`, what `tokenload analyze` writes, with `StepRow`, `SearchSummary`, `ProbeRow` and the
  other blocks;
- `schemas`: the JSON Schema of each, generated from those types; the generated files ship in this package
  (`summary.schema.json`, `manifest.schema.json`) for scripts and CI to validate against.

The types are `TypedDict`s: a summary is still a plain dict (json in, json out), while mypy checks every key
the writer builds and every key a reader reads. Each file carries its `schema_version`. Imports nothing of
the project, so every stage may use it.
"""
