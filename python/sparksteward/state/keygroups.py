"""Key groups: which key group a key belongs to, and which key groups a subtask owns.

A key's key group is ``pmod(xxhash64(key), M)`` with ``M`` the max parallelism, computed exactly as
Spark SQL's ``pmod(xxhash64(col), M)`` computes it on the key column, so rows routed in SQL and
lookups made in Python agree bit for bit. Spark hashes with XXH64 and seed 42:

=========  ===========================================  ==========================
key type   bytes hashed                                 Python value
=========  ===========================================  ==========================
string     the UTF-8 bytes                              ``str``
binary     the bytes                                    ``bytes``
long       8 bytes, little-endian two's complement      ``int`` (the default)
int        4 bytes, little-endian two's complement      ``int`` with ``KeyType.INT``
=========  ===========================================  ==========================

(pinned against ``pyspark.sql.functions.xxhash64`` in ``tests/state/test_keygroups.py``). The result
is read as a signed 64-bit integer and ``pmod`` makes it non-negative.

Subtask ``i`` of parallelism ``P`` owns the contiguous key groups of Flink's
``KeyGroupRangeAssignment.computeKeyGroupRangeForOperatorIndex``: ``[ceil(i*M/P), floor(((i+1)*M-1)/P)]``,
which here is the half-open :class:`KeyGroupRange` ``[start, stop)``. A key group ``g`` belongs to
subtask ``g * P // M``.
"""

from __future__ import annotations

import numbers
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import xxhash

from sparksteward.enums import ParsedEnum
from sparksteward.errors import ParallelismError, StateEncodingError
from sparksteward.wire.messages import MAX_PARALLELISM

__all__ = [
    "SPARK_HASH_SEED",
    "KeyGroupRange",
    "KeyType",
    "decode_key",
    "key_bytes",
    "key_group",
    "key_group_of_bytes",
    "key_group_range",
    "key_groups",
    "spark_xxhash64",
    "subtask_for_key_group",
    "validate_parallelism",
]

SPARK_HASH_SEED = 42
_LONG = struct.Struct("<q")
_INT = struct.Struct("<i")
_KEY_TYPE_ALIASES = {"bigint": "long", "integer": "int", "str": "string", "bytes": "binary"}


class KeyType(ParsedEnum):
    """The Spark SQL type of the key column; it decides the bytes that are hashed and stored."""

    STRING = "string"
    LONG = "long"
    INT = "int"
    BINARY = "binary"

    @classmethod
    def _text(cls, value: object) -> str | None:
        text = str(value).lower()
        return _KEY_TYPE_ALIASES.get(text, text)

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        return StateEncodingError(f"key type {value!r} is not supported: use one of string, long, int, binary "
                                  f"(cast the key column to one of these)")

    @classmethod
    def of(cls, key: object) -> KeyType:
        """The key type a Python value implies (``int`` means long, as in Spark's type inference)."""
        if isinstance(key, str):
            return cls.STRING
        if isinstance(key, (bytes, bytearray, memoryview)):
            return cls.BINARY
        if isinstance(key, numbers.Integral) and not isinstance(key, bool):  # int, numpy integers
            return cls.LONG
        raise StateEncodingError(
            f"key {key!r} of type {type(key).__name__} cannot be a state key: use a str, int or bytes key "
            f"(cast the key column to string, long, int or binary)")


def key_bytes(key: object, key_type: KeyType | str | None = None) -> bytes:
    """The canonical bytes of ``key``: what Spark's xxhash64 hashes, and what the state DB stores."""
    kt = KeyType.of(key) if key_type is None else KeyType.parse(key_type)
    try:
        if kt is KeyType.STRING:
            if not isinstance(key, str):
                raise TypeError
            return key.encode("utf-8")
        if kt is KeyType.BINARY:
            if not isinstance(key, (bytes, bytearray, memoryview)):
                raise TypeError
            return bytes(key)
        if isinstance(key, bool) or not isinstance(key, numbers.Integral):
            raise TypeError
        return (_LONG if kt is KeyType.LONG else _INT).pack(int(key))
    except (TypeError, struct.error, UnicodeEncodeError) as exc:
        raise StateEncodingError(
            f"key {key!r} ({type(key).__name__}) is not a valid {kt.value} key: "
            f"{exc or 'wrong Python type'}; pass keys that match the state's key type") from exc


def _signed(u: int) -> int:
    return u - (1 << 64) if u >= 1 << 63 else u


def spark_xxhash64(key: object, key_type: KeyType | str | None = None) -> int:
    """Spark SQL's ``xxhash64(key)`` (a signed 64-bit integer)."""
    return _signed(xxhash.xxh64_intdigest(key_bytes(key, key_type), seed=SPARK_HASH_SEED))


def decode_key(data: bytes, key_type: KeyType | str) -> Any:
    """The key whose canonical bytes (:func:`key_bytes`) are ``data``."""
    kt = KeyType.parse(key_type)
    if kt is KeyType.STRING:
        return data.decode("utf-8")
    if kt is KeyType.BINARY:
        return bytes(data)
    return (_LONG if kt is KeyType.LONG else _INT).unpack(data)[0]


def key_group_of_bytes(data: bytes, max_parallelism: int) -> int:
    """The key group of already-canonical key bytes."""
    return _signed(xxhash.xxh64_intdigest(data, seed=SPARK_HASH_SEED)) % max_parallelism


def key_group(key: object, max_parallelism: int, key_type: KeyType | str | None = None) -> int:
    """``pmod(xxhash64(key), max_parallelism)``, as Spark SQL computes it."""
    return spark_xxhash64(key, key_type) % max_parallelism


def validate_parallelism(parallelism: int, max_parallelism: int) -> None:
    """Require ``1 <= parallelism <= max_parallelism <= MAX_PARALLELISM`` (32768)."""
    for name, value in (("parallelism", parallelism), ("max_parallelism", max_parallelism)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParallelismError(f"{name} must be an int, not {value!r}")
    if not 1 <= max_parallelism <= MAX_PARALLELISM:
        raise ParallelismError(
            f"max_parallelism={max_parallelism} is out of range: it must be between 1 and "
            f"{MAX_PARALLELISM}. It is the number of key groups and cannot change later, so pick "
            f"an upper bound on the parallelism you will ever need (for example 128)")
    if not 1 <= parallelism <= max_parallelism:
        raise ParallelismError(
            f"parallelism={parallelism} is out of range: it must be between 1 and "
            f"max_parallelism={max_parallelism} (each subtask owns at least one key group)")


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """The key groups ``[start, stop)``; empty when ``start == stop``."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        for v in (self.start, self.stop):
            if isinstance(v, bool) or not isinstance(v, int):
                raise ParallelismError(f"key group bounds must be ints, not {v!r}")
        if not 0 <= self.start <= self.stop <= MAX_PARALLELISM:
            raise ParallelismError(
                f"key group range [{self.start}, {self.stop}) is not valid: need 0 <= start <= stop <= "
                f"{MAX_PARALLELISM}")

    def __len__(self) -> int:
        return self.stop - self.start

    def __contains__(self, group: object) -> bool:
        return isinstance(group, int) and self.start <= group < self.stop

    def __iter__(self):
        return iter(range(self.start, self.stop))

    def __str__(self) -> str:
        return f"[{self.start}, {self.stop})"

    def intersect(self, other: KeyGroupRange) -> KeyGroupRange:
        lo, hi = max(self.start, other.start), min(self.stop, other.stop)
        return KeyGroupRange(lo, max(lo, hi))

    def overlap(self, other: KeyGroupRange) -> int:
        return max(0, min(self.stop, other.stop) - max(self.start, other.start))

    def to_json(self) -> list[int]:
        return [self.start, self.stop]

    @classmethod
    def from_json(cls, value: object) -> KeyGroupRange:
        if not (isinstance(value, list) and len(value) == 2):
            raise ParallelismError(f"key group range {value!r} is not a [start, stop] pair")
        return cls(value[0], value[1])


def key_group_range(max_parallelism: int, parallelism: int, index: int) -> KeyGroupRange:
    """The key groups of subtask ``index`` (Flink's ``KeyGroupRangeAssignment``)."""
    validate_parallelism(parallelism, max_parallelism)
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < parallelism:
        raise ParallelismError(f"subtask index {index!r} is out of range for parallelism {parallelism}")
    start = (index * max_parallelism + parallelism - 1) // parallelism
    end_inclusive = ((index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end_inclusive + 1)


def subtask_for_key_group(max_parallelism: int, parallelism: int, group: int) -> int:
    """The subtask that owns key group ``group`` (Flink's ``computeOperatorIndexForKeyGroup``)."""
    if not 0 <= group < max_parallelism:
        raise ParallelismError(f"key group {group} is out of range for max_parallelism {max_parallelism}")
    return group * parallelism // max_parallelism


def key_groups(keys: Iterable[object], max_parallelism: int, key_type: KeyType | str | None = None) -> list[int]:
    """The key group of every key (one pass; use for a batch of keys)."""
    return [key_group(k, max_parallelism, key_type) for k in keys]
