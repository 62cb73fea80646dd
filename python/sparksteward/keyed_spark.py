"""What :mod:`sparksteward.keyed_state` reads from Spark around a batch: an output schema in Arrow
terms, the state function's failure inside a task error as Spark reports it, and the streaming query
a ``foreachBatch`` call runs in."""

from __future__ import annotations

from typing import Any

from sparksteward.errors import StateError

__all__ = ["arrow_schema", "function_failure", "streaming_query"]


def arrow_schema(spark: Any, schema: Any) -> tuple[Any, Any]:
    """``(StructType, pyarrow.Schema)`` of a StructType or DDL string."""
    from pyspark.sql.types import StructType

    if isinstance(schema, str):
        struct = spark.createDataFrame([], schema).schema
    elif isinstance(schema, StructType):
        struct = schema
    else:
        raise StateError(f"schema {schema!r} must be a pyspark StructType or a DDL string like 'k string, n long'")
    try:
        from pyspark.sql.pandas.types import to_arrow_schema

        return struct, to_arrow_schema(struct)
    except Exception as exc:
        raise StateError(f"schema {struct.simpleString()} has no Arrow equivalent: {exc}") from exc


def function_failure(exc: BaseException, name: str, max_lines: int = 30) -> str | None:
    """The :class:`~sparksteward.errors.StateFunctionError` of state ``name`` inside ``exc``'s text
    (a task's error, as Spark reports it): its first line and the function's traceback, or None."""
    marker = f"StateFunctionError: keyed state {name!r}"
    lines = str(exc).splitlines()
    at = next((i for i, line in enumerate(lines) if marker in line), None)
    if at is None:
        return None
    out = [lines[at][lines[at].index(marker) + len("StateFunctionError: "):]]
    for line in lines[at + 1:at + 1 + max_lines]:
        if not line.strip() or line.startswith(("\tat ", "JVM stacktrace")):
            break
        out.append(line)
    return "\n".join(out)


def streaming_query(df: Any) -> str | None:
    """The id of the streaming query whose ``foreachBatch`` runs this (Spark sets it as a local
    property of the batch's thread); None outside a streaming query."""
    try:
        return df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId") or None
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: no query to record
        return None
