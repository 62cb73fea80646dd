"""Key groups: Spark's xxhash64 reproduced bit for bit, and Flink's key-group ranges."""

from __future__ import annotations

import pytest
from sparksteward.errors import ParallelismError, StateEncodingError
from sparksteward.state.keygroups import (
    KeyGroupRange,
    KeyType,
    key_group,
    key_group_range,
    spark_xxhash64,
    subtask_for_key_group,
    validate_parallelism,
)

from tests.helpers import spark_session

# computed with pyspark 4.3.0: F.xxhash64(col) and pmod(xxhash64(col), 128) in a local[1] session
PINNED = {
    "string": [("", -7444071767201028348, 4), ("a", -8582455328737087284, 76),
               ("user-1", 3245521771936779939, 35), ("héllo wörld", 7620070002295215535, 47),
               ("日本語", -619341062884681239, 105), ("x" * 100, 365730103971579591, 71),
               ("user-123456789", 7869403095745724953, 25)],
    "long": [(0, -5252525462095825812, 108), (1, -7001672635703045582, 50), (-1, 3858142552250413010, 82),
             (42, -6876166290308861218, 94), (2**31, -8411286333845881801, 55),
             (-2**63, -8619748838626508300, 116), (2**63 - 1, -3246596055638297850, 6),
             (123456789012345, 755925937788029102, 46)],
    "int": [(0, 3614696996920510707, 115), (1, -6698625589789238999, 41), (-1, 2017008487422258757, 69),
            (7, 2786828215451145335, 119), (2**31 - 1, 1508894993788531228, 28)],
    "binary": [(bytes.fromhex("0001616263"), -5133681901217764067, 29), (b"", -7444071767201028348, 4)],
}


@pytest.mark.parametrize("key_type", sorted(PINNED))
def test_hash_and_key_group_match_spark_sql(key_type):
    for key, spark_hash, spark_group in PINNED[key_type]:
        assert spark_xxhash64(key, key_type) == spark_hash, key
        assert key_group(key, 128, key_type) == spark_group, key


def test_python_types_imply_spark_types():
    assert KeyType.of("x") is KeyType.STRING and KeyType.of(5) is KeyType.LONG and KeyType.of(b"") is KeyType.BINARY
    assert key_group(1, 128) == 50  # a Python int is a long, as in Spark's type inference
    import numpy as np  # pandas hands numpy scalars to per-key functions

    assert key_group(np.int64(42), 128) == 94 and key_group(np.int32(7), 128, "int") == 119
    with pytest.raises(StateEncodingError, match=r"key 1\.5 of type float cannot be a state key"):
        key_group(1.5, 128)
    with pytest.raises(StateEncodingError, match="not a valid int key"):
        key_group(2**40, 128, "int")
    with pytest.raises(StateEncodingError, match="key type 'double' is not supported"):
        key_group(1, 128, "double")


def test_ranges_follow_flinks_key_group_range_assignment():
    # Flink: start = ceil(i*M/P), end = floor(((i+1)*M - 1)/P) inclusive
    assert [key_group_range(128, 3, i) for i in range(3)] == [
        KeyGroupRange(0, 43), KeyGroupRange(43, 86), KeyGroupRange(86, 128)]
    for m in (1, 7, 128, 1000, 32768):
        for p in {1, 2, 3, 7, min(m, 16), m}:
            if p > m:
                continue
            ranges = [key_group_range(m, p, i) for i in range(p)]
            assert ranges[0].start == 0 and ranges[-1].stop == m
            assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
            assert all(len(r) >= 1 for r in ranges)
            for i, r in enumerate(ranges):
                assert {subtask_for_key_group(m, p, g) for g in r} == {i}


def test_parallelism_validation_names_the_bad_value():
    validate_parallelism(1, 1)
    validate_parallelism(32768, 32768)
    with pytest.raises(ParallelismError, match="max_parallelism=32769 is out of range"):
        validate_parallelism(8, 32769)
    with pytest.raises(ParallelismError, match="parallelism=9 is out of range.*max_parallelism=8"):
        validate_parallelism(9, 8)
    with pytest.raises(ParallelismError, match="parallelism=0 is out of range"):
        validate_parallelism(0, 8)
    with pytest.raises(ParallelismError, match="subtask index 3 is out of range"):
        key_group_range(8, 3, 3)


def test_range_overlap():
    a, b = KeyGroupRange(0, 43), KeyGroupRange(40, 80)
    assert a.overlap(b) == 3 and a.intersect(b) == KeyGroupRange(40, 43)
    assert len(KeyGroupRange(0, 10).intersect(KeyGroupRange(20, 30))) == 0
    assert KeyGroupRange.from_json(a.to_json()) == a


@pytest.mark.slow
def test_pinned_values_against_live_spark():
    """Run once (under the Spark lock) to re-derive PINNED from pyspark."""
    from pyspark.sql import functions as F

    with spark_session("local[1]") as spark:   # a JVM with the shim jar: later sessions of this process need it
        for key_type, rows in PINNED.items():
            df = spark.createDataFrame([(k,) for k, _, _ in rows], f"k {key_type}")
            got = [(r.h, r.g) for r in df.select(F.xxhash64("k").alias("h"),
                                                 F.expr("pmod(xxhash64(k), 128)").alias("g")).collect()]
            assert got == [(h, g) for _, h, g in rows], key_type
            # and the Python side agrees with the live values, not only with the pinned ones
            assert [key_group(k, 128, key_type) for k, _, _ in rows] == [g for _, g in got]
