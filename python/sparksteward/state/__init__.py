"""Keyed state: key groups, the value encoding and the task-side RocksDB backend (issue 8).

Nothing here imports pyspark or ``agents/``; the Spark integration builds on these layers.
"""
