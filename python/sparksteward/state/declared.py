"""Declared state variables (decision 0017): what a keyed state says it keeps, once, when it is opened.

::

    from sparksteward import list_state, map_state, value_state

    states = [value_state("count", "bigint", ttl=timedelta(hours=1)),
              list_state("events", "ts timestamp, v double", ttl=3600, ttl_update="on_read_and_write"),
              map_state("attrs", "string", "double")]

A type is a Spark DDL string (``"bigint"``, ``"ts timestamp, v double"``, ``"struct<a:int,b:string>"``),
a pyspark ``DataType``/``StructType``, or a ``pyarrow.DataType``; it becomes an Arrow type here, without
Spark. A TTL is seconds (a number) or a ``timedelta``; ``ttl_update`` is ``"on_write"`` (the expiry
moves when the entry is created or written, Flink's ``OnCreateAndWrite``) or ``"on_read_and_write"``;
``ttl_time`` is ``"processing"`` (the batch's time, chosen by the driver when the batch begins) or
``"event"`` (the batch's event-time watermark, for a state opened with ``event_time``: decision 0028;
see :mod:`sparksteward.state.typed.ttl` for the time before the first watermark).

**The record.** Every checkpoint keeps the declarations of its state in ``properties.states``
(:func:`resolve` makes it when a state is registered)::

    {"format": 1, "variables": {"count": {"kind": "value", "current": 2, "types": {"1": T1, "2": T2},
                                          "key_type": null, "ttl_ms": 3600000, "ttl_update": "on_write",
                                          "ttl_time": "processing"}, ...},
     "deleted": {"old": {"kind": "list", "current": 3, "pending": true}}}

``types`` holds every schema version a stored value may have been written with: a value is decoded
with its own version's type, then projected to the current one (:mod:`sparksteward.state.rows`).
Declarations are compared in their recorded form (a timestamp of any unit in microseconds, a large
string as a string), so the same declaration always keeps its version. A declaration whose type
differs from the current one becomes a new version when every recorded version can be read as it
(add a nullable field, drop a field, widen a number, make a NOT NULL field nullable); anything else
is refused by name.

**Drops.** A variable the state no longer declares is kept, as Flink keeps undeclared state. One named
in ``delete_states`` leaves ``variables`` for a tombstone in ``deleted`` (:class:`Tombstone`): its
kind, its last schema version and ``pending``. While the drop is pending, :func:`resolve` lists it in
``dropped`` (never recorded: :func:`recorded_form`), and the tasks of every batch delete its entries
and expiry-index keys before the function runs; an open again, with or without ``delete_states``,
keeps it pending. The coordinator clears ``pending`` (:func:`drops_ran`) when a checkpoint whose
tasks were given the drop completes; a re-run of a completed checkpoint keeps its first result, so
it does not. A name declared again starts at the version after the tombstone's (``first``): no
version a stored byte of the dropped variable may carry is reused, and a typed value of an older
version is read as absent, never as the new type.
"""

from __future__ import annotations

import datetime as dt
import re
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, overload

import pyarrow as pa

from sparksteward.errors import StateSchemaError
from sparksteward.state.rows import RowCodec, evolve

__all__ = ["DEFAULT_VARIABLE", "KINDS", "StateSpec", "Tombstone", "VariableRecord", "arrow_type", "drops_ran", "list_state", "map_state",
           "parse_ddl", "pending_drops", "recorded_form", "resolve", "tombstones_of", "type_from_json",
           "type_to_json", "value_state", "variables_of"]

KINDS = ("value", "list", "map")
TTL_UPDATES = ("on_write", "on_read_and_write")
TTL_TIMES = ("processing", "event")
RECORD_FORMAT = 1
#: the default value state's name (``state.get()``/``update()`` per key, ``state.get_many``/``put_many`` in
#: the Arrow form): untyped (JSON) unless declared with ``value_state("value", type)`` (decision 0027)
DEFAULT_VARIABLE = "value"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]{0,99}$")


# --- types ----------------------------------------------------------------------------------------
_DDL_NAMES: dict[str, pa.DataType] = {
    "boolean": pa.bool_(), "bool": pa.bool_(),
    "tinyint": pa.int8(), "byte": pa.int8(), "smallint": pa.int16(), "short": pa.int16(),
    "int": pa.int32(), "integer": pa.int32(), "bigint": pa.int64(), "long": pa.int64(),
    "float": pa.float32(), "real": pa.float32(), "double": pa.float64(),
    "string": pa.string(), "binary": pa.binary(), "date": pa.date32(),
    "timestamp": pa.timestamp("us", tz="UTC"), "timestamp_ltz": pa.timestamp("us", tz="UTC"),
    "timestamp_ntz": pa.timestamp("us"),
}
_JSON_NAMES: dict[str, pa.DataType] = {
    "bool": pa.bool_(), "int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
    "float32": pa.float32(), "float64": pa.float64(), "string": pa.string(), "binary": pa.binary(),
    "date32": pa.date32(), "timestamp_us": pa.timestamp("us"), "timestamp_us_utc": pa.timestamp("us", tz="UTC"),
}
_TOKEN = re.compile(r"\s*(`(?:[^`]|``)+`|[A-Za-z_][A-Za-z0-9_]*|\d+|[<>,:()])")


def parse_ddl(text: str) -> pa.DataType:
    """A Spark DDL type (``"bigint"``, ``"struct<a:int,b:string>"``) or field list (``"a int, b
    string"``) as an Arrow type; a field list becomes a struct."""
    tokens: list[str] = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip() == "":
                break
            raise StateSchemaError(f"type {text!r} is not a Spark DDL type: cannot read {text[pos:pos + 20]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    if not tokens:
        raise StateSchemaError(f"type {text!r} is empty: give a Spark DDL type such as 'bigint' or 'a int, b string'")
    at = 0

    def peek() -> str | None:
        return tokens[at] if at < len(tokens) else None

    def take(expected: str | None = None) -> str:
        nonlocal at
        tok = peek()
        if tok is None or (expected is not None and tok.lower() != expected):
            want = f"{expected!r}" if expected else "more"
            raise StateSchemaError(f"type {text!r} is not a Spark DDL type: expected {want} at {tok!r}")
        at += 1
        return tok

    def name() -> str:
        tok = take()
        return tok[1:-1].replace("``", "`") if tok.startswith("`") else tok

    def field() -> pa.Field:
        n = name()
        if peek() == ":":
            take()
        t = dtype()
        nullable = True
        if peek() is not None and peek().lower() == "not":   # type: ignore[union-attr]
            take()
            take("null")
            nullable = False
        return pa.field(n, t, nullable=nullable)

    def dtype() -> pa.DataType:
        tok = take()
        low = tok.lower()
        if low == "struct":
            take("<")
            fields = [field()]
            while peek() == ",":
                take()
                fields.append(field())
            take(">")
            return pa.struct(fields)
        if low in _DDL_NAMES:
            return _DDL_NAMES[low]
        raise StateSchemaError(
            f"type {text!r}: {tok!r} is not a type state values support; use boolean, tinyint, smallint, int, "
            f"bigint, float, double, string, binary, date, timestamp, timestamp_ntz or a struct of them")

    # a single type, or a field list ("a int, b string")
    if len(tokens) == 1 or tokens[1] in ("<", "("):
        result = dtype()
    else:
        fields = [field()]
        while peek() == ",":
            take()
            fields.append(field())
        result = pa.struct(fields)
    if at != len(tokens):
        raise StateSchemaError(f"type {text!r} is not a Spark DDL type: unexpected {tokens[at]!r}")
    return result


def arrow_type(t: Any, what: str) -> pa.DataType:
    """The Arrow type of a DDL string, a pyspark ``DataType`` or an Arrow type (``what`` names it)."""
    if isinstance(t, pa.DataType):
        return t
    if isinstance(t, str):
        return parse_ddl(t)
    if hasattr(t, "simpleString") and hasattr(t, "jsonValue"):   # a pyspark DataType, converted by pyspark
        try:
            from pyspark.sql.pandas.types import to_arrow_type

            try:   # pyspark 4 asks for the zone of a timestamp: its instants are kept in UTC, as the DDL's
                return to_arrow_type(t, timezone="UTC")
            except TypeError:   # pyspark 3 has no such argument and takes UTC
                return to_arrow_type(t)
        except Exception as exc:  # noqa: BLE001 - pyspark raises its own error types here
            raise StateSchemaError(f"{what}: the type {t.simpleString()} has no Arrow equivalent: {exc}") from None
    raise StateSchemaError(f"{what}: the type {t!r} must be a Spark DDL string like 'bigint' or 'ts timestamp, v "
                           f"double', a pyspark DataType, or a pyarrow DataType")


def type_to_json(t: pa.DataType) -> Any:
    """A JSON form of a type state values support (a name, or a struct's fields)."""
    if pa.types.is_struct(t):
        return {"struct": [{"name": f.name, "type": type_to_json(f.type), "nullable": f.nullable} for f in t]}
    if pa.types.is_timestamp(t):
        return "timestamp_us_utc" if t.tz else "timestamp_us"
    for n, known in _JSON_NAMES.items():
        if known == t:
            return n
    if t == pa.large_string():
        return "string"
    if t == pa.large_binary():
        return "binary"
    raise StateSchemaError(f"type {t} is not one state values support")


def type_from_json(j: Any, nested: bool = False) -> pa.DataType:
    """The type :func:`type_to_json` wrote; a struct holds scalars only (state values are flat)."""
    if isinstance(j, str) and j in _JSON_NAMES:
        return _JSON_NAMES[j]
    if isinstance(j, dict) and isinstance(j.get("struct"), list) and not nested and len(j["struct"]) <= 1024:
        try:
            return pa.struct([pa.field(str(f["name"])[:200], type_from_json(f["type"], nested=True),
                                       nullable=bool(f.get("nullable", True))) for f in j["struct"]])
        except (KeyError, TypeError, AttributeError):
            pass
    raise StateSchemaError(f"recorded state type {reprlib.repr(j)} is not one this version reads: the checkpoint was "
                           f"written by a newer spark-steward, or its record is corrupt")


# --- declarations ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class StateSpec:
    """One declared state variable (make it with :func:`value_state`, :func:`list_state`, :func:`map_state`)."""

    name: str
    kind: str
    type: pa.DataType
    key_type: pa.DataType | None = None     # map state: the type of the map keys
    ttl_ms: int | None = None
    ttl_update: str = "on_write"
    ttl_time: str = "processing"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise StateSchemaError(
                f"state variable name {self.name!r} must be 1-100 letters, digits, '_', '.' or '-', starting with a "
                f"letter or '_'")
        if self.name == "__timers__":   # the offline reader's name for a checkpoint's timers
            raise StateSchemaError(f"state variable name {self.name!r} is reserved (it reads a checkpoint's timers "
                                   f"offline): choose another name")
        if self.name == DEFAULT_VARIABLE and self.kind != "value":
            raise StateSchemaError(
                f"state variable {DEFAULT_VARIABLE!r} is the default value state (state.get()/get_many()): declare "
                f"it with value_state({DEFAULT_VARIABLE!r}, type) to type it, or give your {self.kind} state another "
                f"name")
        if self.kind not in KINDS:
            raise StateSchemaError(f"state variable {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.ttl_update not in TTL_UPDATES:
            raise StateSchemaError(f"state variable {self.name!r}: ttl_update={self.ttl_update!r} must be one of "
                                   f"{TTL_UPDATES}")
        if self.ttl_time not in TTL_TIMES:
            raise StateSchemaError(f"state variable {self.name!r}: ttl_time={self.ttl_time!r} must be one of {TTL_TIMES}")
        if self.ttl_ms is not None and not 0 < self.ttl_ms <= 100 * 365 * 86_400_000:
            raise StateSchemaError(f"state variable {self.name!r}: ttl of {self.ttl_ms} ms must be positive and at "
                                   f"most 100 years")
        RowCodec(self.name, self.type)   # refuses what typed values cannot store, by name
        if self.kind == "map":
            if self.key_type is None:
                raise StateSchemaError(f"map state {self.name!r} needs a key type")
            RowCodec(self.name, self.key_type)
        elif self.key_type is not None:
            raise StateSchemaError(f"state variable {self.name!r}: only a map state has a key type")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "type": type_to_json(self.type),
                "key_type": None if self.key_type is None else type_to_json(self.key_type), "ttl_ms": self.ttl_ms,
                "ttl_update": self.ttl_update, "ttl_time": self.ttl_time}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StateSpec:
        if not isinstance(d, Mapping):
            raise StateSchemaError(f"a state declaration must be an object, not {reprlib.repr(d)}")
        try:
            ttl = d.get("ttl_ms")
            return cls(name=d["name"], kind=d["kind"], type=type_from_json(d["type"]),
                       key_type=None if d.get("key_type") is None else type_from_json(d["key_type"]),
                       ttl_ms=None if ttl is None else int(ttl), ttl_update=d.get("ttl_update", "on_write"),
                       ttl_time=d.get("ttl_time", "processing"))
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, StateSchemaError):
                raise
            raise StateSchemaError(f"state declaration {reprlib.repr(dict(d))} is malformed: {exc}") from None


def duration_ms(value: Any, what: str) -> int:
    """A duration given as seconds (a number) or a ``timedelta``, in ms; ``what`` names it in the error
    (``ttl=...`` of a variable, ``watermark_delay=...``, a window's ``size=...``)."""
    if isinstance(value, dt.timedelta):
        return round(value.total_seconds() * 1000)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return round(float(value) * 1000)
    raise StateSchemaError(f"{what}={value!r} must be seconds (a number) or a timedelta")


def _ttl_ms(ttl: float | dt.timedelta | None, name: str) -> int | None:
    if ttl is None:
        return None
    ms = duration_ms(ttl, f"state variable {name!r}: ttl")
    if ms <= 0:
        raise StateSchemaError(f"state variable {name!r}: ttl={ttl!r} must be positive (or None for no TTL)")
    return ms


def value_state(name: str, type: Any, *, ttl: float | dt.timedelta | None = None, ttl_update: str = "on_write",
                ttl_time: str = "processing") -> StateSpec:
    """A value per key of ``type`` (DDL string, pyspark or Arrow type), expiring ``ttl`` after its last
    write (and read, with ``ttl_update="on_read_and_write"``)."""
    return StateSpec(name, "value", arrow_type(type, f"value state {name!r}"), None, _ttl_ms(ttl, name), ttl_update,
                     ttl_time)


def list_state(name: str, type: Any, *, ttl: float | dt.timedelta | None = None, ttl_update: str = "on_write",
               ttl_time: str = "processing") -> StateSpec:
    """A list per key of elements of ``type``; each element expires on its own ``ttl`` after its append."""
    return StateSpec(name, "list", arrow_type(type, f"list state {name!r}"), None, _ttl_ms(ttl, name), ttl_update,
                     ttl_time)


def map_state(name: str, key_type: Any, value_type: Any, *, ttl: float | dt.timedelta | None = None,
              ttl_update: str = "on_write", ttl_time: str = "processing") -> StateSpec:
    """A map per key from ``key_type`` to ``value_type``; each entry expires on its own ``ttl``."""
    return StateSpec(name, "map", arrow_type(value_type, f"map state {name!r}"),
                     arrow_type(key_type, f"the key type of map state {name!r}"), _ttl_ms(ttl, name), ttl_update,
                     ttl_time)


# --- the record every checkpoint keeps ---------------------------------------------------------------
@dataclass(frozen=True)
class VariableRecord:
    """A declared variable as a checkpoint records it: every schema version's type, and the current one.

    ``first`` is the first version of this declaration's life: a name declared again after a drop
    starts past every version its dropped life used, and a stored value of an older version (left by
    a drop that has not run yet) is not this variable's: the views read it as absent."""

    spec: StateSpec                      # the current declaration
    version: int                         # its schema version
    types: dict[int, pa.DataType]        # every recorded version -> its type (values may be of any)
    first: int = 1                       # versions below belong to a dropped variable of the same name

    def codec(self, version: int | None = None, ttl: bool | None = None) -> RowCodec:
        v = self.version if version is None else version
        t = self.spec.type if v == self.version else self.types.get(v)
        if t is None or v < self.first:
            from sparksteward.errors import StateEncodingError

            why = (f"which belongs to the variable of that name that was dropped (this one starts at version "
                   f"{self.first}): it is not read" if v < self.first else
                   "which the checkpoint's record does not know: it is corrupt")
            raise StateEncodingError(f"a stored value of state {self.spec.name!r} has schema version {v}, {why}")
        return RowCodec(self.spec.name, t, v, self.spec.ttl_ms is not None if ttl is None else ttl)

    def to_json(self) -> dict[str, Any]:
        d = self.spec.to_json()
        del d["name"], d["type"]
        d["current"] = self.version
        d["types"] = {str(v): type_to_json(t) for v, t in sorted(self.types.items())}
        if self.first != 1:
            d["first"] = self.first
        return d


@dataclass(frozen=True)
class Tombstone:
    """A variable dropped with ``delete_states``, as every later checkpoint records it: its kind, its
    last schema version (the versions up to it stay taken: a name declared anew starts after it), and
    whether the drop is still pending (its entries may still be stored: the tasks of every batch run
    it until a checkpoint whose tasks ran it has completed)."""

    kind: str
    current: int
    pending: bool = True

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"kind": self.kind, "current": self.current}
        if self.pending:
            d["pending"] = True
        return d


def variables_of(record: Mapping[str, Any] | None) -> dict[str, VariableRecord]:
    """The variables of a ``properties.states`` record (empty for None: a state that declared none)."""
    if not record:
        return {}
    if not isinstance(record, Mapping) or record.get("format") != RECORD_FORMAT:
        raise StateSchemaError(f"the state declarations a checkpoint recorded have format "
                               f"{record.get('format') if isinstance(record, Mapping) else record!r}, which this "
                               f"version does not read: upgrade spark-steward")
    out: dict[str, VariableRecord] = {}
    for name, d in (record.get("variables") or {}).items():
        try:
            types = {int(v): type_from_json(t) for v, t in d["types"].items()}
            current = int(d["current"])
            first = int(d.get("first", 1))
            spec = StateSpec.from_json({**d, "name": name, "type": d["types"][str(current)]})
            if not 1 <= first <= current or min(types) < first:
                raise ValueError(f"its first version {first} is not within its versions {sorted(types)}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, StateSchemaError):
                raise
            raise StateSchemaError(f"the recorded declaration of state variable {name!r} is malformed: {exc}") from None
        out[name] = VariableRecord(spec, current, types, first)
    return out


def tombstones_of(record: Mapping[str, Any] | None) -> dict[str, Tombstone]:
    """The dropped variables of a ``properties.states`` record (see :class:`Tombstone`)."""
    if not record:
        return {}
    variables_of(record)   # the format check
    out: dict[str, Tombstone] = {}
    for name, d in (record.get("deleted") or {}).items():
        try:
            t = Tombstone(str(d["kind"]), int(d["current"]), bool(d.get("pending", False)))
            if t.kind not in KINDS or not 0 < t.current <= 0xFFFF or not _NAME.match(name):
                raise ValueError(f"kind {t.kind!r}, version {t.current}")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateSchemaError(f"the recorded drop of state variable {reprlib.repr(name)} is malformed: "
                                   f"{exc}") from None
        out[name] = t
    return out


def pending_drops(record: Mapping[str, Any] | None) -> frozenset[str]:
    """The variables whose drop has not been completed by a checkpoint whose tasks ran it: the tasks of
    every batch delete their entries (:func:`~sparksteward.state.typed.drop_variables`) before the
    function runs."""
    return frozenset(n for n, t in tombstones_of(record).items() if t.pending)


def _record(variables: Mapping[str, VariableRecord], tombstones: Mapping[str, Tombstone]) -> dict[str, Any]:
    out: dict[str, Any] = {"format": RECORD_FORMAT, "variables": {n: r.to_json() for n, r in sorted(variables.items())}}
    if tombstones:
        out["deleted"] = {n: t.to_json() for n, t in sorted(tombstones.items())}
    out["dropped"] = sorted(n for n, t in tombstones.items() if t.pending)
    return out


@overload
def drops_ran(record: None, names: Iterable[str]) -> None: ...
@overload
def drops_ran(record: Mapping[str, Any], names: Iterable[str]) -> dict[str, Any]: ...
def drops_ran(record: Mapping[str, Any] | None, names: Iterable[str]) -> dict[str, Any] | None:
    """``record`` once a checkpoint whose tasks ran the drops ``names`` has completed: those drops are
    no longer pending (their versions stay taken); a drop of a name declared again since is forgotten,
    the new declaration's first version keeps its versions taken."""
    if record is None:
        return None
    ran = set(names)
    variables = variables_of(record)
    tombstones = {n: (Tombstone(t.kind, t.current, False) if n in ran else t)
                  for n, t in tombstones_of(record).items() if not (n in ran and n in variables)}
    return _record(variables, tombstones)


def recorded_form(record: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What a checkpoint records of ``record`` in ``properties.states``: the declarations and the drops
    (those still pending included), without the tasks' list of drops to run; None when the state
    declares nothing and dropped nothing."""
    if not record or not (record.get("variables") or record.get("deleted")):
        return None
    return {k: v for k, v in record.items() if k != "dropped"}


def resolve(recorded: Mapping[str, Any] | None, specs: Iterable[StateSpec | Mapping[str, Any]],
            delete: Sequence[str] = (), *, state: str = "", checkpointed: bool = False) -> dict[str, Any]:
    """The record of a state opened with ``specs`` over the one its latest checkpoint ``recorded``
    (see the module docstring); raises :class:`StateSchemaError` naming what cannot be opened.
    ``checkpointed``: the state has a completed checkpoint (or restores one), whose default value
    state, if the record does not declare it, holds JSON values that a typed declaration would misread."""
    where = f"keyed state {state!r}: " if state else ""
    old = variables_of(recorded)
    tombstones = tombstones_of(recorded)
    # compared in their recorded form: the record keeps a timestamp in microseconds, a large string as a
    # string (type_to_json), and the tasks read the record's types
    declared = [StateSpec.from_json(s.to_json() if isinstance(s, StateSpec) else s) for s in specs]
    seen: set[str] = set()
    for s in declared:
        if s.name in seen:
            raise StateSchemaError(f"{where}state variable {s.name!r} is declared twice; declare each name once")
        seen.add(s.name)
    for name in delete:
        if name in seen:
            raise StateSchemaError(f"{where}state variable {name!r} is both declared and in delete_states; delete it "
                                   f"in one application, then declare it anew in the next")
    variables = {n: r for n, r in old.items() if n not in delete}
    for name in delete:   # dropped again (a second open) or never declared: nothing more to record
        if name in old:
            tombstones[name] = Tombstone(old[name].spec.kind, old[name].version)
    for s in declared:
        was = variables.get(s.name)
        if was is None and s.name == DEFAULT_VARIABLE and checkpointed:
            raise StateSchemaError(
                f"{where}its default value state is untyped (JSON) in the checkpoints it has, and a typed "
                f"declaration (value_state({DEFAULT_VARIABLE!r}, ...)) cannot read those values: the default is typed "
                f"only from a state's first checkpoint. Open it without that declaration (the default stays JSON), or "
                f"declare a new name (value_state('agg', ...)) and move the values over in a batch")
        if was is None:
            gone = tombstones.get(s.name)
            v = 1 if gone is None else gone.current + 1   # never a version the dropped one's bytes carry
            if v > 0xFFFF:
                raise StateSchemaError(f"{where}state variable {s.name!r} was dropped at the last schema version "
                                       f"and cannot be declared again: declare it under a new name")
            variables[s.name] = VariableRecord(s, v, {v: s.type}, v)
            if gone is not None and not gone.pending:
                del tombstones[s.name]   # its first version keeps the versions taken
            continue
        fix = (f"declare it under a new name, or pass delete_states=[{s.name!r}] once to drop its entries and "
               f"then declare it anew")
        if was.spec.kind != s.kind:
            raise StateSchemaError(f"{where}state variable {s.name!r} was a {was.spec.kind} state and is now declared "
                                   f"a {s.kind} state: {fix}")
        if s.kind == "map" and was.spec.key_type != s.key_type:
            raise StateSchemaError(f"{where}the map keys of state variable {s.name!r} were {was.spec.key_type} and "
                                   f"are now declared {s.key_type}; map keys cannot change type: {fix}")
        if was.spec.type == s.type:
            variables[s.name] = VariableRecord(s, was.version, was.types, was.first)
            continue
        for v, t in sorted(was.types.items()):
            problem = evolve(t, s.type)
            if problem:
                raise StateSchemaError(f"{where}state variable {s.name!r} cannot be read as declared: version {v} of "
                                       f"its values has type {t} and the new declaration {s.type}; {problem}. "
                                       f"Accepted changes: add a nullable field, drop a field, widen a number. Or "
                                       f"{fix}")
        if was.version >= 0xFFFF:
            raise StateSchemaError(f"{where}state variable {s.name!r} has reached the last schema version: {fix}")
        variables[s.name] = VariableRecord(s, was.version + 1, {**was.types, was.version + 1: s.type}, was.first)
    return _record(variables, tombstones)
