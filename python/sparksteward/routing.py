"""Routing rows to subtasks in Spark SQL, as strings and numbers (no pyspark import here).

A row with key ``k`` belongs to key group ``g = pmod(xxhash64(k), M)`` and so to subtask
``g * P div M`` (:mod:`sparksteward.state.keygroups` computes the same in Python). The Spark side
sends it to partition ``subtask``:

- pyspark 4.1+: ``df.repartitionById(P, subtask)`` (exact);
- pyspark 4.0: ``df.repartition(P, route)`` with ``route = element_at(array(v_0, ..., v_{P-1}), subtask + 1)``,
  where :func:`routing_values` picks ints ``v_i`` whose Spark hash lands in partition ``i``:
  ``repartition`` puts a row at ``pmod(murmur3(route, seed 42), P)``, and :func:`spark_hash_int`
  reproduces Spark's ``Murmur3_x86_32.hashInt``.

Both are checked against a live Spark in ``tests/state/test_routing.py``.
"""

from __future__ import annotations

import re

from sparksteward.errors import StateEncodingError
from sparksteward.state.keygroups import validate_parallelism

__all__ = ["key_group_sql", "route_sql", "routing_values", "spark_hash_int", "subtask_sql"]

_MASK = 0xFFFFFFFF
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _quote(column: str) -> str:
    if not isinstance(column, str) or not column:
        raise StateEncodingError(f"key column {column!r} must be a non-empty column name")
    return column if _IDENT.match(column) else "`" + column.replace("`", "``") + "`"


def key_group_sql(column: str, max_parallelism: int) -> str:
    """SQL for the key group of ``column``: ``pmod(xxhash64(column), M)``."""
    validate_parallelism(1, max_parallelism)
    return f"pmod(xxhash64({_quote(column)}), {max_parallelism})"


def subtask_sql(column: str, parallelism: int, max_parallelism: int) -> str:
    """SQL for the subtask of ``column`` (an int in ``[0, P)``)."""
    validate_parallelism(parallelism, max_parallelism)
    return f"CAST({key_group_sql(column, max_parallelism)} * {parallelism} DIV {max_parallelism} AS INT)"


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's ``Murmur3_x86_32.hashInt(value, seed)`` (what ``hash(int_col)`` and ``repartition`` use)."""
    k1 = (value & _MASK) * 0xCC9E2D51 & _MASK
    k1 = _rotl(k1, 15) * 0x1B873593 & _MASK
    h1 = (seed & _MASK) ^ k1
    h1 = (_rotl(h1, 13) * 5 + 0xE6546B64) & _MASK
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & _MASK
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & _MASK
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 >= 1 << 31 else h1


def routing_values(parallelism: int) -> list[int]:
    """Smallest non-negative ints ``v_i`` with ``pmod(spark_hash_int(v_i), P) == i``, for every ``i``."""
    if isinstance(parallelism, bool) or not isinstance(parallelism, int) or parallelism < 1:
        raise StateEncodingError(f"parallelism {parallelism!r} must be an int >= 1")
    found: dict[int, int] = {}
    v = 0
    while len(found) < parallelism:
        found.setdefault(spark_hash_int(v) % parallelism, v)
        v += 1
    return [found[i] for i in range(parallelism)]


def route_sql(subtask_expr: str, parallelism: int) -> str:
    """SQL for the int column that ``repartition(P, col)`` sends to partition ``subtask`` (pyspark 4.0)."""
    values = ", ".join(map(str, routing_values(parallelism)))
    return f"element_at(array({values}), ({subtask_expr}) + 1)"
