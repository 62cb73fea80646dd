"""What the cross-host suites run on the (single) executor of the standalone worker."""

from __future__ import annotations


def on_executor(spark, fn):
    """Run ``fn()`` in one task on the (single) executor and return its result."""
    return spark.sparkContext.parallelize([0], 1).map(lambda _: fn()).collect()[0]


def executor_cache_stats():
    from sparksteward.worker import executor_connection

    return executor_connection().request("blob.cache_stats")["stats"]
