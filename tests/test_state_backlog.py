"""A new input schema while rows an unaligned batch deferred are pending (FLIP-76) is refused by name,
without Spark: the task's input assembled from a real channel-state file."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sparksteward.checkpoint.channel import ChannelStateWriter
from sparksteward.errors import StateError
from sparksteward.state.keyed import _KG_COL, _unaligned_input
from sparksteward.state.keygroups import KeyGroupRange

M = 8
UNALIGNED = {"alignment": "unaligned", "aligned_checkpoint_timeout": 0}


def _replay_file(path, batch: pa.RecordBatch) -> list[dict]:
    w = ChannelStateWriter(path)
    w.append(batch)
    w.close()
    return [{"name": f"channel state {path.name}", "path": str(path)}]


@pytest.mark.parametrize("unaligned", [False, True])
def test_a_new_input_schema_while_rows_are_deferred_is_refused_naming_the_fix(tmp_path, unaligned):
    old = pa.RecordBatch.from_pydict({"k": ["a", "b"], "v": pa.array([1, 2], pa.int64())})
    new = pa.RecordBatch.from_pydict({"k": ["c"], "v": pa.array([1.5], pa.float64())})
    same = pa.RecordBatch.from_pydict({"k": ["c"], "v": pa.array([3], pa.int64())})
    opened = {"replay": _replay_file(tmp_path / "ch", old), "key_type": "string", "channel": str(tmp_path / "out"),
              "alignment": UNALIGNED if unaligned else None, "deadline_in": 60.0 if unaligned else None, "cut": None}

    def feed(batch):
        if unaligned:   # the task adds the key-group column to an unaligned state's new input
            batch = batch.append_column(_KG_COL, pa.array([1] * batch.num_rows, pa.int32()))
        source, writer, _ = _unaligned_input(opened, iter([batch]), "k", KeyGroupRange(0, M), M,
                                             lambda cut, overflow: cut, "subtask 0 of checkpoint 4 of keyed state 's'")
        try:
            return [b.num_rows for b in source]
        finally:
            if writer is not None:
                writer.abort()

    assert feed(same) == [2, 1]
    with pytest.raises(StateError) as err:
        feed(new)
    msg = str(err.value)
    assert "subtask 0 of checkpoint 4 of keyed state 's'" in msg
    assert "(k string, v double)" in msg and "(k string, v int64)" in msg
    assert "Drain the deferred rows with an aligned batch (ks.drain(...)) before changing the input schema" in msg
