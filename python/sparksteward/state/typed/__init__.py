"""The views of declared state variables (decision 0017): typed value, list and map states with TTL,
each in a vectorized form (over many keys at once, Arrow in and out) and bound to one key (the per-key
form). :class:`TypedStates` holds the declared variables of one subtask's backend at one batch's
processing time.

One module per idea:

- :mod:`~sparksteward.state.typed.base`: the shared base of the views (keys, writes, decoding) and
  the layout of values, list elements and map entries in RocksDB;
- :mod:`~sparksteward.state.typed.value`, :mod:`~sparksteward.state.typed.list` and
  :mod:`~sparksteward.state.typed.map`: the three kinds, each with its per-key form;
- :mod:`~sparksteward.state.typed.states`: :class:`TypedStates`, the holder;
- :mod:`~sparksteward.state.typed.ttl`: the expiry index, :func:`sweep_expired` and
  :func:`drop_variables`;
- :mod:`~sparksteward.state.typed.arrow_keys`: the RocksDB keys of a column of keys and their key order;
- :mod:`~sparksteward.state.typed.columns`: the columns the views are given, as Arrow or Python lists.

The dependencies go one way: ``states`` -> the kinds -> ``base`` -> ``ttl``, ``arrow_keys``,
``columns``; ``base`` knows its holder only through the :class:`~sparksteward.state.typed.base.Holder`
protocol.
"""

from sparksteward.state.typed.arrow_keys import key_order, keys_of
from sparksteward.state.typed.list import BoundList, TypedList
from sparksteward.state.typed.map import BoundMap, TypedMap
from sparksteward.state.typed.states import TypedStates
from sparksteward.state.typed.ttl import (
    EXPIRY_KINDS,
    KIND_EXPIRY,
    KIND_EXPIRY_EVENT,
    SweepStats,
    drop_variables,
    index_expiry,
    index_key,
    restore_clock,
    sweep_both,
    sweep_expired,
)
from sparksteward.state.typed.value import BoundValue, TypedValue

__all__ = [
    "EXPIRY_KINDS",
    "KIND_EXPIRY",
    "KIND_EXPIRY_EVENT",
    "BoundList",
    "BoundMap",
    "BoundValue",
    "SweepStats",
    "TypedList",
    "TypedMap",
    "TypedStates",
    "TypedValue",
    "drop_variables",
    "index_expiry",
    "index_key",
    "restore_clock",
    "sweep_both",
    "sweep_expired",
]

# the names these had when the package was one module (tests/state/test_typed.py and
# benchmarks/bench_state_ceiling.py use them)
_key_order = key_order
_raw_keys = keys_of
