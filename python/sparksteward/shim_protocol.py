"""The versioned line protocol between the JVM shim and the agents (see ``docs/protocol.md``).

:func:`decode` validates one shim → agent line against :data:`SCHEMAS` and returns it as a dict; it
raises :class:`~sparksteward.errors.ProtocolError` naming the problem, never anything deeper.
:func:`encode_ready` and :func:`encode_fatal` write the agent → shim lines byte-for-byte as the
golden files in ``jvm-shim/src/test/resources/golden`` show. :func:`encode_metrics` writes the
driver agent's numbers for Spark's metrics system (the shim turns each name into a gauge).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import orjson

from sparksteward.errors import ProtocolError

__all__ = ["MAX_LINE", "PLUGIN_CLASS", "SCHEMAS", "VERSION", "decode", "encode_fatal", "encode_metrics",
           "encode_ready"]

VERSION = 1
#: The shim's SparkPlugin class, as given to ``spark.plugins``.
PLUGIN_CLASS = "sparksteward.shim.StewardPlugin"
MAX_LINE = 1 << 20

_S, _I, _L, _D, _N = str, int, list, dict, type(None)
_TASK: dict[str, tuple[type, ...]] = {"time": (_I,), "task_attempt_id": (_I,), "stage_id": (_I,),
                                      "stage_attempt_id": (_I,), "partition_id": (_I,), "attempt_number": (_I,)}

#: For every message type: field -> allowed JSON types.
SCHEMAS: dict[str, dict[str, tuple[type, ...]]] = {
    "hello": {"role": (_S,), "executor_id": (_S,), "host": (_S,), "bind_host": (_S,), "port": (_I,),
              "driver_endpoint": (_S, _N), "rendezvous_dir": (_S, _N), "secret": (_S,), "conf": (_D,)},
    "app_start": {"time": (_I,), "app_id": (_S,), "attempt_id": (_S, _N), "app_name": (_S,),
                  "spark_version": (_S,), "user": (_S,)},
    "app_end": {"time": (_I,), "exit_code": (_I, _N), "checkpoint_dir": (_S, _N)},
    "job_start": {"time": (_I,), "job_id": (_I,), "job_group": (_S, _N), "job_tags": (_L,),
                  "description": (_S, _N), "num_stages": (_I,), "stage_ids": (_L,)},
    "job_end": {"time": (_I,), "job_id": (_I,), "result": (_S,), "reason": (_S, _N)},
    "executor_added": {"time": (_I,), "executor_id": (_S,), "host": (_S,), "total_cores": (_I,)},
    "executor_removed": {"time": (_I,), "executor_id": (_S,), "reason": (_S,)},
    "task_start": _TASK,
    "task_succeeded": _TASK,
    "task_failed": {**_TASK, "reason": (_S,)},
    "shutdown": {"time": (_I,), "reason": (_S,)},
    # before the next line, when the JVM's log4j root level changed (sc.setLogLevel); replayed on restart
    "log_level": {"level": (_S,)},
    # shim -> agent request over the pipes, answered by one "reply" line with the same id (decision 0009)
    "open_file": {"id": (_I,), "url": (_S,)},
    # agent -> shim
    "ready": {"role": (_S,), "pid": (_I,), "endpoint": (_S,), "shutdown_grace_ms": (_I,)},
    "fatal": {"role": (_S,), "code": (_S,), "message": (_S,)},
    "reply": {"id": (_I,), "ok": (bool,)},
    "metrics": {"values": (_D,)},  # name -> number, each a gauge in the driver plugin's metricRegistry
}


def decode(line: bytes | str) -> dict[str, Any]:
    """Parse and validate one protocol line. Unknown extra fields are kept (forward compatible)."""
    if len(line) > MAX_LINE:
        raise ProtocolError(f"protocol line of {len(line)} bytes exceeds {MAX_LINE}")
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"protocol line is not JSON: {str(line)[:120]!r}") from exc
    if not isinstance(msg, dict):
        raise ProtocolError(f"protocol line is not a JSON object: {str(line)[:120]!r}")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} is not supported (this agent speaks {VERSION}); "
                            f"use a shim jar built from the same spark-steward version (`steward jar`)")
    kind = msg.get("type")
    schema = SCHEMAS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ProtocolError(f"unknown protocol message type {kind!r}")
    for name, types in schema.items():
        if name not in msg:
            raise ProtocolError(f"{kind} message lacks field {name!r}")
        value = msg[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise ProtocolError(f"{kind} message field {name!r} has the wrong type: {value!r}")
    return msg


def _encode(kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"v": VERSION, "type": kind, **fields}) + b"\n"


def encode_ready(role: str, pid: int, endpoint: str, shutdown_grace_ms: int) -> bytes:
    """The ``ready`` line an agent prints once it serves requests."""
    return _encode("ready", role=role, pid=pid, endpoint=endpoint, shutdown_grace_ms=shutdown_grace_ms)


def encode_fatal(role: str, code: str, message: str) -> bytes:
    """The ``fatal`` line an agent prints before exiting when it cannot start."""
    return _encode("fatal", role=role, code=code, message=message)


def encode_metrics(values: Mapping[str, int | float]) -> bytes:
    """The ``metrics`` line: the latest value of each of the agent's numbers, names sorted.

    The shim registers a Dropwizard gauge per new name in the driver plugin's ``metricRegistry`` and
    keeps the latest value for it, so Spark's metrics sinks report it. Raises ProtocolError naming a
    name that is empty or has control characters, or a value that is not a finite number.
    """
    for name, value in values.items():
        if not isinstance(name, str) or not name:
            raise ProtocolError(f"metric name {name!r} is empty or not a string")
        if any(ord(c) < 0x20 for c in name):
            raise ProtocolError(f"metric name {name!r} has a control character")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ProtocolError(f"metric {name!r} = {value!r} is not a number")
        if not math.isfinite(value):
            raise ProtocolError(f"metric {name!r} = {value!r} is not a finite number")
    return _encode("metrics", values=dict(sorted(values.items())))


def encode_reply(request_id: int, reply: dict[str, Any] | None = None, *, code: str = "", message: str = "") -> bytes:
    """The ``reply`` line answering a shim request (``open_file``): ``ok`` with the reply's fields, or
    an error ``{"code", "message"}`` when ``reply`` is None."""
    if reply is not None:
        return _encode("reply", id=request_id, ok=True, **reply)
    return _encode("reply", id=request_id, ok=False, error={"code": code, "message": message})
