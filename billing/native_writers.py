"""clickhouse-connect's writers of two column types, the same bytes in C loops.

The sink's insert writes eight ``LowCardinality(String)`` columns (model, status,
precision, ...) and ``flags``, an ``Array(LowCardinality(String))``. clickhouse-connect
builds a low-cardinality column's dictionary in a Python loop (a lookup and an append
per value) and an array column's offsets in another (a ``len``, an append and an
``extend`` per row): together a tenth of the sink's Python work per event. The types
here write the same Native bytes (the unit tests hold them to clickhouse-connect's own)
with the loops in C: ``dict.fromkeys`` and ``map`` for the dictionary, ``accumulate``
and ``chain`` for the array. ``faster_writer`` swaps them in for the types an insert
context reads from the table.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import accumulate, chain
from typing import Any

from clickhouse_connect.datatypes.base import ClickHouseType
from clickhouse_connect.datatypes.container import Array
from clickhouse_connect.datatypes.string import String
from clickhouse_connect.driver.common import must_swap


class LowCardinalityText(String, registered=False):  # type: ignore[misc]
    """``LowCardinality(String)``: the dictionary of distinct values in first-seen order,
    and each row's position in it, as clickhouse-connect's loop makes them."""

    def _build_lc_dictionary(self, column: Sequence[Any], ctx: Any) -> tuple[list[Any], list[int]]:
        if self.nullable:  # a null takes position 0: left to clickhouse-connect
            result: tuple[list[Any], list[int]] = super()._build_lc_dictionary(column, ctx)
            return result
        index = list(dict.fromkeys(column))
        if len(index) == 1:  # one value in every row, as for most of the sink's columns
            return index, [0] * len(column)
        position = {value: n for n, value in enumerate(index)}
        return index, list(map(position.__getitem__, column))


class FlatArrays(Array, registered=False):  # type: ignore[misc]
    """``Array(T)`` of a T that is not an array: each row's end offset, then every row's
    values as one column of T, as clickhouse-connect writes a one-level array."""

    def write_column_data(self, column: Sequence[Any], dest: bytearray, ctx: Any) -> None:
        if isinstance(self.element_type, Array):  # nested: clickhouse-connect's own loop
            super().write_column_data(column, dest, ctx)
            return
        offsets = array("Q", accumulate(map(len, column)))
        if must_swap:
            offsets.byteswap()
        dest += offsets.tobytes()
        self.element_type.write_column_data(list(chain.from_iterable(column)), dest, ctx)


def faster_writer(column_type: ClickHouseType) -> ClickHouseType:
    """``column_type`` as one of the types above where there is one, else itself."""
    if type(column_type) is String and column_type.low_card and not column_type.nullable:
        return LowCardinalityText(column_type.type_def)
    if type(column_type) is Array and not column_type.nullable:
        arrays = FlatArrays(column_type.type_def)
        arrays.element_type = faster_writer(arrays.element_type)
        return arrays
    return column_type
