"""Keyed state: key groups, routing, the value encoding, the task-side RocksDB backend and the
Arrow/pandas runners. See ``docs/state.md``.

Nothing here imports pyspark, ``checkpoint/`` or ``agents/``; checkpoints (``checkpoint/``) and the
Spark-facing ``KeyedState`` (``keyed_state.py``) build on this layer.

The names below are imported from their modules on first use, like the root's declarations: importing
``sparksteward.state.keygroups`` (as the driver agent does) loads neither rocksdict nor pyarrow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sparksteward.lazy import lazy_face

if TYPE_CHECKING:
    from sparksteward.state.backend import RocksDBStateBackend
    from sparksteward.state.keygroups import KeyGroupRange, KeyType, key_group, key_group_range, validate_parallelism
    from sparksteward.state.runner import KeyedStateAccess, KeyState, run_arrow, run_pandas
    from sparksteward.state.snapshot import LocalSnapshot
    from sparksteward.state.views import (
        BoundListState,
        BoundMapState,
        BoundValueState,
        ListState,
        MapState,
        ValueState,
    )

#: each exported name's module (under this package)
_EXPORTS = {
    "RocksDBStateBackend": "backend",
    "KeyGroupRange": "keygroups",
    "KeyType": "keygroups",
    "key_group": "keygroups",
    "key_group_range": "keygroups",
    "validate_parallelism": "keygroups",
    "KeyedStateAccess": "runner",
    "KeyState": "runner",
    "run_arrow": "runner",
    "run_pandas": "runner",
    "LocalSnapshot": "snapshot",
    "BoundListState": "views",
    "BoundMapState": "views",
    "BoundValueState": "views",
    "ListState": "views",
    "MapState": "views",
    "ValueState": "views",
}


__getattr__, __dir__ = lazy_face(__name__, _EXPORTS, globals())


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
