"""What a user sees when their state function fails, in Spark (local[2], the shared session): the
first lines of a batch's error name the state, the checkpoint, the subtask and the key, and carry the
function's own exception; a streaming query's exception has the same line. Run under the Spark lock."""

from __future__ import annotations

import logging

import pandas as pd
import pytest
from sparksteward import Steward
from sparksteward.errors import StorageError

pytestmark = pytest.mark.slow


def bad_row(key, rows, state):
    state.update(1)
    raise ValueError("bad row 42")


def head(exc: BaseException, n: int = 5) -> str:
    return "\n".join(str(exc).splitlines()[:n])


def test_a_failing_function_names_the_state_and_its_error_first_in_a_batch(spark, tmp_path):
    ks = Steward.get(spark).keyed_state("user-errors", key="k", parallelism=2, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    df = spark.createDataFrame(pd.DataFrame({"k": ["a", "b"], "v": [1, 2]}))
    with pytest.raises(Exception) as info:
        ks.apply(df, bad_row, "k string, n long", checkpoint_id=0).collect()
    first = head(info.value)
    assert "keyed state 'user-errors', checkpoint 0, subtask " in first, str(info.value)
    assert "the state function raised ValueError: bad row 42" in first
    assert "key 'a'" in first or "key 'b'" in first
    assert "state.release" not in str(info.value)
    assert 'raise ValueError("bad row 42")' in str(info.value)  # the function's own traceback follows


def test_a_per_key_function_returning_a_string_or_a_row_of_the_wrong_width_is_told_what_to_return(spark, tmp_path):
    ks = Steward.get(spark).keyed_state("returns-str", key="k", parallelism=1, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    df = spark.createDataFrame(pd.DataFrame({"k": ["a"], "v": [1]}))
    with pytest.raises(Exception) as info:
        ks.apply(df, lambda key, rows, state: key, "k string, n long", checkpoint_id=0).collect()
    assert ("keyed state 'returns-str', checkpoint 0, subtask 0, key 'a': the state function returned str; "
            "return a row (a tuple in the schema's column order, or a dict), a list of rows, a pandas DataFrame, "
            "or None") in head(info.value)
    with pytest.raises(Exception) as info:
        ks.apply(df, lambda key, rows, state: (key,), "k string, n long", checkpoint_id=0).collect()
    assert ("key 'a': the state function returned a row of 1 values ('a',); the declared schema has 2 columns "
            "['k', 'n']: return one value per column, in that order") in head(info.value)
    # rows are the cheap output of the per-key form: a tuple, a dict or a list of them
    out = ks.apply(df, lambda key, rows, state: [(key, 1), {"n": 2, "k": key}], "k string, n long",
                   checkpoint_id=0).collect()
    assert sorted((r.k, r.n) for r in out) == [("a", 1), ("a", 2)]


def test_a_failing_function_names_the_state_and_its_error_first_in_a_streaming_query(spark, tmp_path, caplog):
    ks = Steward.get(spark).keyed_state("user-errors-stream", key="k", parallelism=2, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    source = tmp_path / "in"
    source.mkdir()
    pd.DataFrame({"k": ["a", "b"], "v": [1, 2]}).to_json(source / "part-0.json", orient="records", lines=True)
    run = ks.process(bad_row, "k string, n long", sink=lambda out, batch_id: out.count())
    q = (spark.readStream.schema("k string, v long").json(str(source)).writeStream.foreachBatch(run)
         .option("checkpointLocation", str(tmp_path / "query")).trigger(availableNow=True).start())
    caplog.set_level(logging.WARNING, logger="sparksteward")
    try:
        with pytest.raises(Exception) as info:
            q.awaitTermination(120)
    finally:
        q.stop()
    # py4j formats the foreachBatch function's traceback (its frames, then the error) into the query's
    # exception, so the task's error comes after about 25 lines of them; its first line says it all
    text = str(info.value)
    line = next(x for x in text.splitlines() if "keyed state 'user-errors-stream'" in x)
    assert "StateFunctionError: keyed state 'user-errors-stream', checkpoint 0, subtask " in line, text[:3000]
    assert "the state function raised ValueError: bad row 42" in line
    assert "state.release" not in text
    # the console shows it first, before Spark's exception: the state's line, then the function's frame
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert shown, "nothing was logged when the batch failed"
    first = "\n".join(shown[0].splitlines()[:5])
    assert first.startswith("batch 0 of keyed state 'user-errors-stream' failed: keyed state 'user-errors-stream', "
                            "checkpoint 0, subtask "), shown[0]
    assert "the state function raised ValueError: bad row 42" in first.splitlines()[0]
    assert 'raise ValueError("bad row 42")' in shown[0] and "state.release" not in shown[0]


def test_a_checkpoint_dir_that_cannot_be_created_fails_by_name_before_any_task(spark, tmp_path):
    """The dir lies under a regular file, so it can never be made: keyed_state() (its check lists the
    state's dir) or else the first apply (which takes the writer lease) fails naming the state, the dir and
    the fix, and no task ran."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint dir's parent should be")
    chk = blocker / "chk"
    marker = tmp_path / "ran"

    def count(key, rows, state):
        marker.write_text("a task ran")
        return pd.DataFrame({"k": [key], "n": [len(rows)]})

    df = spark.createDataFrame(pd.DataFrame({"k": ["a", "b"], "v": [1, 2]}))
    with pytest.raises(StorageError) as info:
        ks = Steward.get(spark).keyed_state("bad-dir", key="k", parallelism=2, max_parallelism=8,
                                            checkpoint_dir=str(chk))
        ks.apply(df, count, "k string, n long", checkpoint_id=0).collect()
    assert head(info.value, 1).startswith(f"keyed state 'bad-dir' cannot use its checkpoint dir {chk}: "), info.value
    assert "Not a directory" in str(info.value) and "pass a checkpoint_dir" in str(info.value)
    assert not marker.exists()


def test_a_null_key_through_process_is_raised_as_our_error_first(spark, tmp_path, caplog):
    """Issue 40: the null key's message was 28 lines down a PythonException. process() raises it as
    ours (Spark's chain kept on the error, ``spark_error``, and in the log), logged first."""
    from sparksteward.errors import StateEncodingError

    ks = Steward.get(spark).keyed_state("null-keys", key="k", parallelism=2, max_parallelism=8,
                                        checkpoint_dir=str(tmp_path / "chk"))
    run = ks.process(lambda key, rows, state: (key, len(rows)), "k string, n long",
                     sink=lambda out, batch_id: out.write.format("noop").mode("overwrite").save())
    df = spark.createDataFrame(pd.DataFrame({"k": ["a", None, None], "v": [1, 2, 3]}), "k string, v long")
    caplog.set_level(logging.WARNING, logger="sparksteward")
    with pytest.raises(StateEncodingError) as info:
        run(df, 0)
    assert str(info.value) == "key column 'k' has 2 null values; filter or fill them first"
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "PythonException" in type(info.value.spark_error).__name__
    shown = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert shown and shown[0] == ("batch 0 of keyed state 'null-keys' failed: key column 'k' has 2 null values; "
                                  "filter or fill them first"), shown
    assert ks.info()["pending"] == []   # the batch's checkpoint was aborted
