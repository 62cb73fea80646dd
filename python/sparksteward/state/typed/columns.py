"""The columns the typed views are given: keys and values as an Arrow array, a pandas or numpy column,
or a Python sequence, turned into a Python list (:func:`as_pylist`) or into an Arrow array of a
declared type (:func:`as_arrow`), with a :class:`~sparksteward.errors.StateEncodingError` naming the
state when they do not fit."""

from __future__ import annotations

from typing import Any, cast

import pyarrow as pa

from sparksteward.errors import StateEncodingError

__all__ = ["as_arrow", "as_pylist"]


def as_pylist(values: Any) -> list[Any]:
    """``values`` (Arrow, pandas, numpy or any iterable) as a Python list."""
    to_pylist = getattr(values, "to_pylist", None)
    if to_pylist is not None:
        return cast("list[Any]", to_pylist())
    tolist = getattr(values, "tolist", None)
    if tolist is not None:
        return cast("list[Any]", tolist())
    return list(values)


def as_arrow(values: Any, dtype: pa.DataType, name: str) -> pa.Array:
    """``values`` as one Arrow array of type ``dtype`` (cast if it is Arrow of another type); state
    ``name`` is named in the error when they do not fit. For a struct type, a table or record batch
    with a column per field is taken as the struct array of its rows."""
    if isinstance(values, (pa.Table, pa.RecordBatch)) and pa.types.is_struct(dtype):
        names = [dtype.field(i).name for i in range(dtype.num_fields)]
        missing = [n for n in names if n not in values.column_names]
        if missing:
            raise StateEncodingError(f"state {name!r} is declared {dtype}, but the table of values lacks columns "
                                     f"{missing} (it has {values.column_names})")
        columns = [values.column(n) for n in names]
        values = pa.StructArray.from_arrays(
            [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns], names=names)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        if values.type == dtype:
            return values
        try:
            return values.cast(dtype)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise StateEncodingError(f"state {name!r} is declared {dtype}, but the values have type {values.type}, "
                                     f"which does not cast: {exc}") from None
    try:
        return pa.array(as_pylist(values) if not isinstance(values, list) else values, type=dtype)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise StateEncodingError(f"values for state {name!r} do not fit its declared type {dtype}: {exc}") from None
