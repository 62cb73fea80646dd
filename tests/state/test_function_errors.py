"""A state function's failures, without Spark: the error names the state, the checkpoint, the subtask
and the key on its first line, with the function's exception and its traceback; a per-key function
that returns anything but rows or a DataFrame is told what to return; committing a state never applied says
what to do."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest
from sparksteward.errors import StateError, StateFunctionError, StateNotRegisteredError
from sparksteward.keyed_state import KeyedState
from sparksteward.keyed_tasks import guarded
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange
from sparksteward.state.runner import run_pandas

WHERE = "keyed state 'orders', checkpoint 7, subtask 3"


def bad_row(key, rows, state):
    raise ValueError("bad row 42\nsecond line")


def test_a_raising_per_key_function_is_named_with_its_exception_and_traceback_first():
    with pytest.raises(StateFunctionError) as info:
        guarded(bad_row, "pandas", WHERE)("user-1", pd.DataFrame(), None)
    lines = str(info.value).splitlines()
    assert lines[0] == ("keyed state 'orders', checkpoint 7, subtask 3, key 'user-1': "
                        "the state function raised ValueError: bad row 42")
    assert lines[1] == "Traceback (most recent call last):"
    assert "in bad_row" in lines[2] and "guarded" not in str(info.value)  # the function's frames only
    assert lines[-2:] == ["ValueError: bad row 42", "second line"]
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.code == "STATE_FUNCTION" and isinstance(info.value, StateError)


def test_an_arrow_function_names_the_first_keys_of_its_batch():
    with pytest.raises(StateFunctionError, match=r"^keyed state 'orders', checkpoint 7, subtask 3, keys \['a', 'b', "
                                                 r"'c'\] \.\.\. \(5 in the batch\): the state function raised KeyError"):
        guarded(lambda keys, rows, state: {}["x"], "arrow", WHERE)(pa.array(list("abcde")), None, None)


@pytest.mark.parametrize("result", [pa.table({"k": ["a"]}), "text", 42, {"a"}])
def test_a_per_key_function_returning_anything_but_rows_or_a_dataframe_is_told_what_to_return(result, tmp_path):
    """The runner checks what the function returns (the task prefixes the state, checkpoint and subtask:
    tests/keyed_state/test_user_errors_spark.py)."""
    schema = pa.schema([("k", pa.string())])
    with RocksDBStateBackend(tmp_path / "w", KeyGroupRange(0, 8), 8) as backend, \
            pytest.raises(StateFunctionError) as info:
        list(run_pandas(pa.table({"k": ["a"]}).to_batches(), "k", lambda key, rows, state: result, backend, schema))
    assert str(info.value) == (f"key 'a': the state function returned {type(result).__name__}; return a "
                               f"row (a tuple in the schema's column order, or a dict), a list of rows, a pandas "
                               f"DataFrame, or None")


def test_what_a_function_returns_passes_through():
    frame = pd.DataFrame({"k": ["a"]})
    assert guarded(lambda key, rows, state: frame, "pandas", WHERE)("a", None, None) is frame
    assert guarded(lambda key, rows, state: None, "pandas", WHERE)("a", None, None) is None
    for rows in (("a", 1), {"k": "a"}, [("a", 1), ("a", 2)]):
        assert guarded(lambda key, r, state, rows=rows: rows, "pandas", WHERE)("a", None, None) is rows
    table = pa.table({"k": ["a"]})
    assert guarded(lambda keys, rows, state: table, "arrow", WHERE)(pa.array(["a"]), None, None) is table


class _AgentWithoutTheState:
    def ask(self, request):
        raise StateNotRegisteredError(f"keyed state {request.name!r} is not registered with the driver agent")


def test_commit_on_a_state_never_applied_says_what_to_do():
    ks = KeyedState(_AgentWithoutTheState(), "orders", key="k", parallelism=2, max_parallelism=8)
    with pytest.raises(StateError, match=r"keyed state 'orders' has nothing to commit: no batch was applied to it "
                                         r"in this application. Apply one first \(ks.apply\(df, fn, schema\)"):
        ks.commit()
