"""The typed hand-offs (tokenload/contracts): the schemas that ship, the docs, and the writers agree with the types.

Every summary.json and manifest.json the suite writes is validated against the shipped schemas at the end of
the session (tests/conftest.py, tests/contractfiles.py); these tests check the rest of the chain.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, get_args, get_type_hints, is_typeddict

import pytest
from jsonschema import Draft202012Validator

from tokenload.analysis.steps import INT_KEYS, STEP_KEYS
from tokenload.compat import tomllib
from tokenload.contracts.manifest import Manifest
from tokenload.contracts.schemas import SCHEMAS, generated, shipped
from tokenload.contracts.summary import StepRow, Summary

ROOT = Path(__file__).resolve().parent.parent
SUMMARY_DOC = ROOT / "docs" / "summary.md"


def test_the_shipped_schemas_are_what_the_types_generate() -> None:
    """`python -m tokenload.contracts.schemas` writes them; a type changed without that fails here."""
    for name, text in generated().items():
        assert (ROOT / "tokenload" / "contracts" / name).read_text(encoding="utf-8") == text, (
            f"{name} is stale: run `python -m tokenload.contracts.schemas`")
        Draft202012Validator.check_schema(shipped(name))


def test_the_schemas_ship_as_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]
    assert "tokenload.contracts" in config["packages"]
    assert config["package-data"]["tokenload.contracts"] == ["*.schema.json"]
    assert set(SCHEMAS) == {p.name for p in (ROOT / "tokenload" / "contracts").glob("*.schema.json")}


def _typed(hint: Any) -> list[type]:
    """The TypedDicts a hint holds (through Optional, lists, dicts)."""
    if is_typeddict(hint):
        return [hint]
    return [t for arg in get_args(hint) for t in _typed(arg)]


def _reachable(root: type) -> list[type]:
    seen: list[type] = []
    todo = [root]
    while todo:
        typed = todo.pop()
        if typed not in seen:
            seen.append(typed)
            todo += [t for hint in get_type_hints(typed).values() for t in _typed(hint)]
    return seen


def test_every_summary_key_is_named_in_docs_summary_md() -> None:
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", SUMMARY_DOC.read_text(encoding="utf-8")))
    missing = {t.__name__: sorted(set(get_type_hints(t)) - words) for t in _reachable(Summary)}
    assert not {k: v for k, v in missing.items() if v}, "docs/summary.md does not name these keys"


def test_the_docs_table_lists_exactly_the_top_level_keys() -> None:
    table = re.findall(r"^\| `([a-z_0-9]+)` \|", SUMMARY_DOC.read_text(encoding="utf-8"), re.MULTILINE)
    assert sorted(table) == sorted(get_type_hints(Summary)), "docs/summary.md's 'Every top-level key' table"


def _resolve(path: str) -> type:
    """'fits.ttft_vs_input', 'steps[]', 'steps[].server' -> the TypedDict there."""
    typed: type = Summary
    for part in path.replace("[]", "").split("."):
        (typed,) = _typed(get_type_hints(typed)[part])
    return typed


def test_the_keys_scripts_read_are_keys_of_the_types() -> None:
    """docs/summary.md's block (the contract's list): each `path {key, key: ..., ...}` names keys its type has."""
    block = SUMMARY_DOC.read_text(encoding="utf-8").split("## The keys scripts read", 1)[1].split("```")[1]
    entries = re.findall(r"^(\S+)\s+(.*?)(?=^\S|\Z)", block.partition("\n")[2], re.MULTILINE | re.DOTALL)
    assert len(entries) >= 8
    for path, body in entries:
        if path == "schema_version":
            assert "schema_version" in get_type_hints(Summary) and "schema_version" in get_type_hints(Manifest)
            continue
        typed = _resolve(path)
        known = {k for t in _reachable(typed) for k in get_type_hints(t)}
        braces = re.sub(r'"[^"]*"|\([^)]*\)|\[lo, hi\]', "", body[body.index("{"):body.rindex("}") + 1])
        named = set(re.findall(r"[a-z_][a-z0-9_]*", braces)) - {"null", "bool"}
        assert named <= known, f"{path}: {sorted(named - known)} are not keys of {typed.__name__}"


def test_the_step_rows_keys_and_their_int_keys_come_from_the_type() -> None:
    hints = get_type_hints(StepRow)
    assert list(STEP_KEYS) == [k for k in hints if k not in ("bounds", "ci", "errors_by_kind", "server")]
    assert STEP_KEYS[:17] == ("step", "load_level", "load_unit", "active_users", "requests", "censored", "errors",
                              "error_rate", "rps", "output_tok_s", "ttft_p50_s", "ttft_p95_s", "tpot_p50_s",
                              "tpot_p95_s", "e2e_p95_s", "slo_attainment", "formula_mape")  # the contract's, first
    assert INT_KEYS == {k for k, hint in hints.items() if hint is int} - {"step"}


@pytest.mark.parametrize(("name", "wrong", "said"), [
    ("summary.schema.json", {"schema_version": 2}, "1 was expected"),
    ("manifest.schema.json", {"host": {"hostname": "h", "cpus": 2}}, "'platform' is a required property"),
])
def test_the_schemas_refuse_what_the_types_do_not_allow(name: str, wrong: dict[str, Any], said: str) -> None:
    """A wrong version, a missing field of a nested record, a key nobody typed: each one is an error."""
    errors = [e.message for e in Draft202012Validator(shipped(name)).iter_errors({**wrong, "an_untyped_key": 1})]
    assert said in errors, errors
    assert any("'an_untyped_key' was unexpected" in m for m in errors), errors
