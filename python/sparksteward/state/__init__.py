"""Keyed state: key groups, routing, the value encoding, the task-side RocksDB backend and the
Arrow/pandas runners. See ``docs/state.md``.

Nothing here imports pyspark, ``checkpoint/`` or ``agents/``; checkpoints (``checkpoint/``) and the
Spark-facing ``KeyedState`` (``keyed_state.py``) build on this layer.
"""

from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange, KeyType, key_group, key_group_range, validate_parallelism
from sparksteward.state.runner import KeyedStateAccess, KeyState, run_arrow, run_pandas
from sparksteward.state.snapshot import LocalSnapshot
from sparksteward.state.views import BoundListState, BoundMapState, BoundValueState, ListState, MapState, ValueState

__all__ = [
    "BoundListState",
    "BoundMapState",
    "BoundValueState",
    "KeyGroupRange",
    "KeyState",
    "KeyType",
    "KeyedStateAccess",
    "ListState",
    "LocalSnapshot",
    "MapState",
    "RocksDBStateBackend",
    "ValueState",
    "key_group",
    "key_group_range",
    "run_arrow",
    "run_pandas",
    "validate_parallelism",
]
