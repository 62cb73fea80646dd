"""Routing in Spark SQL: the SQL strings agree with the Python key groups, Spark's Murmur3 hashInt is
reproduced, and (slow, under the Spark lock) rows land on exactly their subtask's partition."""

from __future__ import annotations

import pytest
from sparksteward.errors import ParallelismError, StateEncodingError
from sparksteward.routing import key_group_sql, route_sql, routing_values, spark_hash_int, subtask_sql
from sparksteward.state.keygroups import key_group, subtask_for_key_group

from tests.helpers import spark_session


def test_sql_strings():
    assert key_group_sql("user", 128) == "pmod(xxhash64(user), 128)"
    assert subtask_sql("user", 8, 128) == "CAST(pmod(xxhash64(user), 128) * 8 DIV 128 AS INT)"
    assert key_group_sql("user id", 4) == "pmod(xxhash64(`user id`), 4)"
    with pytest.raises(ParallelismError, match="parallelism=9 is out of range"):
        subtask_sql("k", 9, 8)
    with pytest.raises(StateEncodingError, match="must be a non-empty column name"):
        key_group_sql("", 8)


def test_routing_values_land_in_their_partition():
    for p in (1, 2, 3, 8, 16, 200):
        values = routing_values(p)
        assert [spark_hash_int(v) % p for v in values] == list(range(p))
    assert route_sql("s", 2).startswith("element_at(array(")


def test_murmur3_matches_known_spark_values():
    # hash(0) and hash(1) for an int column in Spark 3.x/4.x with seed 42
    assert spark_hash_int(0) == 933211791
    assert spark_hash_int(1) == -559580957


@pytest.mark.slow
def test_rows_reach_their_subtask_in_spark():
    from pyspark.sql import functions as F

    with spark_session("local[2]") as spark:   # a JVM with the shim jar: later sessions of this process need it
        p, m = 5, 64
        df = spark.range(2000).select(F.concat(F.lit("user-"), F.col("id").cast("string")).alias("user"))
        df = df.withColumn("subtask", F.expr(subtask_sql("user", p, m)))
        got = {r.user: r.subtask for r in df.collect()}
        assert got == {u: subtask_for_key_group(m, p, key_group(u, m)) for u in got}
        probe = spark.range(64).select(F.col("id").cast("int").alias("v"),
                                       F.expr("hash(CAST(id AS INT))").alias("h")).collect()
        assert all(spark_hash_int(r.v) == r.h for r in probe)
        routed = df.withColumn("route", F.expr(route_sql("subtask", p))).repartition(p, "route")
        placed = routed.select("subtask", F.spark_partition_id().alias("part")).distinct().collect()
        assert all(r.subtask == r.part for r in placed)
        if hasattr(df, "repartitionById"):
            placed = df.repartitionById(p, "subtask").select(
                "subtask", F.spark_partition_id().alias("part")).distinct().collect()
            assert all(r.subtask == r.part for r in placed)
