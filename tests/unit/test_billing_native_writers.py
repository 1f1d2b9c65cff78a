"""The sink's column writers write the bytes clickhouse-connect's own writers write."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from clickhouse_connect.datatypes.registry import get_from_name

from billing.native_writers import FlatArrays, LowCardinalityText, faster_writer

_TEXTS: list[list[Any]] = [
    ["tiny-llama"],
    ["ok"] * 300,
    ["", "", ""],
    ["ok", "failed", "ok", "cancelled", "failed", "ok"],
    ["fp16", "int8", "bf16", "fp16", "ümlaut", "", "fp16"],
    [f"worker-{n % 300}" for n in range(1000)],  # past 256 values: two-byte positions
]
_ARRAYS: list[list[Any]] = [
    [[]],
    [[] for _ in range(50)],
    [["a"], [], ["b", "a"], [], [], ["c"]],
    [[f"flag-{n % 7}"] * (n % 3) for n in range(400)],
    [["same", "same"], ["same"]],
]


_CONTEXT = SimpleNamespace(encoding=None, column_name="c")
"""What the writers read of clickhouse-connect's insert context."""


def _written(column_type: Any, column: list[Any]) -> bytes:
    dest = bytearray()
    column_type.write_column(column, dest, _CONTEXT)
    return bytes(dest)


@pytest.mark.parametrize("column", _TEXTS)
def test_low_cardinality_text_writes_the_bytes_clickhouse_connect_writes(
    column: list[Any],
) -> None:
    reference = get_from_name("LowCardinality(String)")
    faster = faster_writer(reference)
    assert isinstance(faster, LowCardinalityText)
    assert faster.name == reference.name
    assert _written(faster, column) == _written(reference, column)


def test_a_column_of_one_value_is_one_entry_and_a_position_per_row() -> None:
    # faster_writer is typed as any ClickHouseType; for this type it is ours, whose
    # dictionary builder needs no insert context.
    faster = cast(LowCardinalityText, faster_writer(get_from_name("LowCardinality(String)")))
    assert faster._build_lc_dictionary(["x"] * 4, None) == (["x"], [0, 0, 0, 0])
    assert faster._build_lc_dictionary(["b", "a", "b"], None) == (["b", "a"], [0, 1, 0])


@pytest.mark.parametrize("column", _ARRAYS)
def test_flat_arrays_write_the_bytes_clickhouse_connect_writes(column: list[Any]) -> None:
    reference = get_from_name("Array(LowCardinality(String))")
    faster = faster_writer(reference)
    assert isinstance(faster, FlatArrays)
    assert isinstance(faster.element_type, LowCardinalityText)
    assert faster.name == reference.name
    assert faster.insert_name == reference.insert_name
    assert _written(faster, column) == _written(reference, column)


def test_arrays_of_other_types_and_nested_arrays_write_the_same_bytes() -> None:
    cases: list[tuple[str, list[Any]]] = [
        ("Array(String)", [["a", "b"], [], ["c"]]),
        ("Array(UInt32)", [[1, 2, 3], [], [4]]),
        ("Array(Array(String))", [[["a"], []], [], [["b", "c"]]]),
    ]
    for name, column in cases:
        reference = get_from_name(name)
        faster = faster_writer(reference)
        assert isinstance(faster, FlatArrays)
        assert _written(faster, column) == _written(reference, column), name


def test_nullable_low_cardinality_is_left_to_clickhouse_connect() -> None:
    reference = get_from_name("LowCardinality(Nullable(String))")
    assert faster_writer(reference) is reference
    for name in ("String", "UInt32", "Decimal(38, 9)", "DateTime64(3, 'UTC')"):
        column_type = get_from_name(name)
        assert faster_writer(column_type) is column_type
