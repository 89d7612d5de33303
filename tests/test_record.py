"""The record contract (tokenload.record): one definition, and everything that follows from it agrees.

A record is built on the load side as a plain dict and written through
pyarrow, which silently drops keys its schema lacks: these tests make a key
the load side produces but the contract does not define (or a type that
disagrees with the Arrow column) a test failure instead of a lost column.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Literal, get_args, get_origin

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fakeserver import FakeServer, api_base, stream_script

from tokenload.analysis import records as analysis_records
from tokenload.channel import Channel
from tokenload.load import records as load_records
from tokenload.protocolspec import PROTOCOLS
from tokenload.record import COLUMNS, SPEC_COLUMNS, RequestRecord, SpecRecord, arrow_schema, column_types
from tokenload.rundir import REQUESTS_FILE
from tokenload.transport.httpx_client import stream_once

# The contract's per-request record: changing this list is changing the published contract.
SPEC = (
    "request_id run_id worker user_id step active_users scheduled_at started_at protocol model status "
    "error_kind http_status ttfb_s ttft_s ttft_text_s tpot_s e2e_s input_tokens input_tokens_source "
    "output_tokens output_tokens_source max_tokens chunks itl_p50_s itl_p99_s itl_max_s stop_reason"
).split()


def test_spec_columns_are_specs_and_come_first() -> None:
    assert list(SPEC_COLUMNS) == SPEC
    assert COLUMNS[: len(SPEC)] == SPEC_COLUMNS
    assert len(set(COLUMNS)) == len(COLUMNS)


def test_arrow_schema_is_the_typed_dict() -> None:
    """Same names, same order, and each Python type maps to the Arrow type the segments are written with."""
    schema = arrow_schema()
    assert load_records.SCHEMA.equals(schema)
    assert tuple(schema.names) == COLUMNS == load_records.COLUMNS
    expected = {str: pa.string(), float: pa.float64(), int: pa.int64(), bool: pa.bool_()}
    for name, hint in column_types().items():
        if typing.get_origin(hint) is typing.Annotated:
            assert schema.field(name).type == pa.int32(), name
        elif typing.get_origin(hint) is typing.Literal:
            assert schema.field(name).type == pa.string(), name
        else:
            assert schema.field(name).type == expected[hint], name
    assert [n for n in COLUMNS if schema.field(n).type == pa.int32()] == ["step", "active_users", "http_status"]
    assert all(schema.field(n).nullable for n in COLUMNS)


def test_typed_dicts_are_not_total() -> None:
    """A record is built in stages and old run directories lack newer columns: no key is required."""
    assert RequestRecord.__required_keys__ == frozenset() == SpecRecord.__required_keys__
    assert set(RequestRecord.__optional_keys__) == set(COLUMNS)


def test_analysis_reads_only_defined_columns() -> None:
    assert analysis_records.REQUIRED_COLUMNS == SPEC_COLUMNS
    for group in (analysis_records.FLOAT_COLUMNS, analysis_records.CATEGORY_COLUMNS,
                  analysis_records.ANALYSIS_COLUMNS, analysis_records.LEFT_OUT):
        assert set(group) <= set(COLUMNS), set(group) - set(COLUMNS)


def test_every_record_column_reaches_the_analysis_unless_it_is_left_out_by_name(tmp_path: Path) -> None:
    """The analysis' frame is derived from `RequestRecord`: a new column is never silently absent (before,
    `prompt_tokens_target` was read and then dropped, and every column outside five hand-made lists was absent)."""
    types = column_types()
    sample = {str: "x", float: 1.5, int: 2, bool: False}
    row = {name: (get_args(hint)[0] if get_origin(hint) is Literal else sample.get(hint, 3))
           for name, hint in types.items()}
    row.update(status="ok", phase="measure", in_flight=False, error_kind=None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    pq.write_table(pa.Table.from_pylist([row, row], schema=arrow_schema()), run_dir / REQUESTS_FILE)
    frame = set(analysis_records.load_run(run_dir).df.columns)
    assert set(COLUMNS) - set(analysis_records.LEFT_OUT) <= frame, set(COLUMNS) - set(analysis_records.LEFT_OUT) - frame


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_real_exchange_fits_the_schema_without_loss(fake_server: FakeServer, protocol: str) -> None:
    """Every key a real request's record carries is a column, and survives the Arrow round trip unchanged."""
    fake_server.play(stream_script(protocol, ["Hel", "lo"], 0.01, 0.01))
    record = stream_once(Channel(base_url=api_base(fake_server.url, protocol), protocol=protocol, api_key="sk-test-record"), "Say hello.", 8)
    assert record["status"] == "ok" and record["chunks"] == 2
    assert set(record) <= set(COLUMNS), set(record) - set(COLUMNS)
    row = pa.Table.from_pylist([record], schema=load_records.SCHEMA).to_pylist()[0]
    assert {k: row[k] for k in record} == record
