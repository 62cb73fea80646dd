"""spark-steward: Flink runtime services for PySpark."""

__version__ = "0.1.0"
