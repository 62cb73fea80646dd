"""What :mod:`sparksteward.keyed_state` reads from Spark around a batch: an output schema in Arrow
terms, our error (a state function's failure, a null key, a bad output) inside a task error as Spark
reports it, and the streaming query a ``foreachBatch`` call runs in."""

from __future__ import annotations

import re
from typing import Any

from sparksteward import errors
from sparksteward.errors import StateError, StewardError

__all__ = ["arrow_schema", "as_ours", "check_event_column", "streaming_query", "task_failure"]


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

        try:   # timestamps zoned as mapInArrow sends them, in the session's time zone (pyspark 4.3 asks for it)
            return struct, to_arrow_schema(struct, timezone=spark.conf.get("spark.sql.session.timeZone", "UTC"))
        except TypeError:   # pyspark 4.0-4.2: zoned UTC by itself
            return struct, to_arrow_schema(struct)
    except Exception as exc:
        raise StateError(f"schema {struct.simpleString()} has no Arrow equivalent: {exc}") from exc


_EVENT_TYPES = ("TimestampType", "TimestampNTZType", "DateType", "LongType", "IntegerType")


def check_event_column(df: Any, event_time: Any, state: str) -> None:
    """Refuse, before the batch begins, an input without the state's event-time column or with one of a
    type that holds no time (decision 0028)."""
    if event_time is None:
        return
    fields = {f.name: f.dataType for f in df.schema.fields}
    column = event_time.column
    if column not in fields:
        raise errors.StateEncodingError(
            f"event-time column {column!r} of keyed state {state!r} does not exist; the DataFrame has columns "
            f"{list(fields)}: keep it in the input, or open the state with event_time=<the column that has it>")
    if type(fields[column]).__name__ not in _EVENT_TYPES:
        raise errors.StateEncodingError(
            f"event-time column {column!r} of keyed state {state!r} is {fields[column].simpleString()}: it must be "
            f"a timestamp, a date or a bigint of epoch milliseconds (cast it, e.g. F.col({column!r}).cast('timestamp'))")


_OURS = re.compile(r"sparksteward\.errors\.([A-Za-z]+Error): (.*)$")


def task_failure(exc: BaseException, max_lines: int = 30) -> tuple[type[StewardError], str] | None:
    """Our error inside ``exc``'s text (a task's error, as Spark reports it, in a Python worker's
    traceback): its class and its message, with the lines that follow it (a state function's own
    traceback), up to the JVM's frames; None when the task failed for another reason."""
    lines = str(exc).splitlines()
    for at, line in enumerate(lines):
        found = _OURS.search(line)
        if found is None:
            continue
        cls = getattr(errors, found.group(1), None)
        if not (isinstance(cls, type) and issubclass(cls, StewardError)):
            continue
        out = [found.group(2)]
        for more in lines[at + 1:at + 1 + max_lines]:
            if not more.strip() or more.startswith(("\tat ", "JVM stacktrace", " SQLSTATE")):
                break
            out.append(more)
        return cls, "\n".join(out)
    return None


def as_ours(failure: tuple[type[StewardError], str], spark_error: BaseException) -> StewardError:
    """The error to raise for :func:`task_failure`'s ``failure``, with Spark's on it (``spark_error``)."""
    try:
        ours = failure[0](failure[1])
    except TypeError:   # an error class built otherwise (RemoteError): ours all the same
        ours = StateError(failure[1])
    ours.spark_error = spark_error   # type: ignore[attr-defined]
    return ours


def streaming_query(df: Any) -> str | None:
    """The id of the streaming query whose ``foreachBatch`` runs this (Spark sets it as a local
    property of the batch's thread); None outside a streaming query."""
    try:
        return df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId") or None
    except Exception:  # noqa: BLE001 - Spark Connect has no SparkContext: no query to record
        return None
