"""FLIP-76 channel state (issue 10, first slice): the versioned file format, the writer's byte cap,
deferring at a buffer boundary once the timeout passed, and the key-group filter of a rescaled replay.
Spark-free; real Arrow IPC files on disk."""

from __future__ import annotations

import pyarrow as pa
import pytest

from sparksteward.checkpoint.channel import (
    AlignmentOptions,
    ChannelStateWriter,
    iter_deferring,
    read_channel_state,
    replay,
)
from sparksteward.errors import CheckpointCorruptError, ConfigError
from sparksteward.state.keygroups import KeyGroupRange, key_group


def _batches(n: int, rows: int = 100) -> list[pa.RecordBatch]:
    return [pa.RecordBatch.from_pydict({"k": [f"u{(i * rows + j) % 37}" for j in range(rows)],
                                        "v": list(range(i * rows, (i + 1) * rows))}) for i in range(n)]


def test_deferred_buffers_round_trip_in_order(tmp_path):
    w = ChannelStateWriter(tmp_path / "ch")
    src = _batches(5)
    for b in src:
        assert w.append(b)
    assert not (tmp_path / "ch").exists()  # staged until close
    stats = w.close()
    assert (stats.batches, stats.rows) == (5, 500) and stats.bytes == (tmp_path / "ch").stat().st_size
    assert pa.Table.from_batches(list(read_channel_state(tmp_path / "ch"))) == pa.Table.from_batches(src)


def test_nothing_deferred_writes_no_file(tmp_path):
    w = ChannelStateWriter(tmp_path / "ch")
    assert w.close() is None and not list(tmp_path.iterdir())


@pytest.mark.parametrize("damage, message", [
    (lambda b: b"NOTSTEW" + b[7:], r"is not a spark-steward channel-state file"),
    (lambda b: b[:7] + bytes([9]) + b[8:], r"was written by a newer spark-steward \(version 9; this one reads up to 1\)"),
    (lambda b: b[: len(b) // 2], r"is corrupt or torn"),
])
def test_a_bad_channel_state_file_is_named(tmp_path, damage, message):
    w = ChannelStateWriter(tmp_path / "ch")
    for b in _batches(3):
        w.append(b)
    w.close()
    (tmp_path / "ch").write_bytes(damage((tmp_path / "ch").read_bytes()))
    with pytest.raises(CheckpointCorruptError, match=rf"channel-state file .*ch {message}"):
        list(read_channel_state(tmp_path / "ch"))


def test_defers_everything_after_the_deadline_and_always_processes_one_buffer(tmp_path):
    src = _batches(6)
    w = ChannelStateWriter(tmp_path / "ch")
    counters: dict[str, int] = {}
    calls = iter([False, False, True])   # the deadline passes before the 4th buffer
    out = list(iter_deferring(src, deadline_passed=lambda: next(calls, True), writer=w, counters=counters))
    assert out == src[:3]
    assert pa.Table.from_batches(list(read_channel_state(w.close().path))) == pa.Table.from_batches(src[3:])
    assert counters == {"rows_processed": 300, "rows_deferred": 300, "unaligned": 1}
    # timeout 0: still one buffer processed, so every batch makes progress
    w2 = ChannelStateWriter(tmp_path / "ch2")
    assert list(iter_deferring(src, deadline_passed=lambda: True, writer=w2, counters={})) == src[:1]
    assert pa.Table.from_batches(list(read_channel_state(w2.close().path))).num_rows == 500
    # full buffers are written as they came; pieces (a filtered replay) are joined up to a full buffer
    assert [b.num_rows for b in read_channel_state(w2.path)] == [100] * 5
    w3 = ChannelStateWriter(tmp_path / "ch3")
    for b in [src[0]] + [src[1].slice(i, 10) for i in range(0, 100, 10)]:
        w3.append(b)
    assert [b.num_rows for b in read_channel_state(w3.close().path)] == [100, 100]


def test_max_inflight_takes_the_deferred_buffers_back_and_finishes_aligned_in_order(tmp_path):
    src = _batches(6)
    cap = src[0].nbytes * 2 + 10  # room for two deferred buffers, not three
    w = ChannelStateWriter(tmp_path / "ch", max_bytes=cap)
    counters: dict[str, int] = {}
    out = list(iter_deferring(src, deadline_passed=lambda: True, writer=w, counters=counters))
    assert [b["v"][0].as_py() for b in out] == [b["v"][0].as_py() for b in src]  # every row, in order
    assert w.close() is None and not list(tmp_path.iterdir())
    assert counters == {"rows_processed": 600, "rows_deferred": 0, "unaligned": 0}


def test_bad_options_and_a_cap_below_one_buffer_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"aligned_checkpoint_timeout=-1 must be a number of seconds >= 0"):
        AlignmentOptions(alignment="unaligned", aligned_checkpoint_timeout=-1)
    with pytest.raises(ConfigError, match=r"alignment='sideways' is not valid"):
        AlignmentOptions(alignment="sideways")
    with pytest.raises(ConfigError, match=r"max_inflight_bytes=0 must be a positive"):
        AlignmentOptions(max_inflight_bytes=0)
    w = ChannelStateWriter(tmp_path / "ch", max_bytes=100)
    with pytest.raises(ConfigError, match=r"an input buffer of \d+ bytes is larger than max_inflight_bytes=100: a "
                                          r"cap below one buffer can never defer anything"):
        w.append(_batches(1)[0])


def test_a_rescaled_replay_keeps_only_its_key_groups(tmp_path):
    m = 16
    files = []
    for i in range(3):  # three old subtasks' channel state
        w = ChannelStateWriter(tmp_path / f"ch{i}")
        for b in _batches(2):
            w.append(b)
        files.append((f"ch{i}", tmp_path / f"ch{i}"))
        w.close()
    keep = KeyGroupRange(0, 8)
    rows = pa.Table.from_batches(list(replay(files, "k", keep, m, "string")))
    assert rows.num_rows > 0
    assert all(key_group(k, m, "string") < 8 for k in rows.column("k").to_pylist())
    every = pa.Table.from_batches([b for _, f in files for b in read_channel_state(f)])
    expected = sum(1 for k in every.column("k").to_pylist() if key_group(k, m, "string") < 8)
    assert rows.num_rows == expected
