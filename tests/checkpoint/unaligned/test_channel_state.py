"""FLIP-76 channel state: the versioned file format, the writer's byte cap, cuts that make every
attempt of a checkpoint process and defer the same rows whatever their order and timing, and the
key-group filter of a rescaled replay. Spark-free; real Arrow IPC files on disk."""

from __future__ import annotations

import pyarrow as pa
import pytest
from sparksteward.checkpoint.begun import Cut
from sparksteward.checkpoint.unaligned.channel_state import (
    AlignmentOptions,
    ChannelStateWriter,
    logical_size,
    read_channel_state,
    replay,
)
from sparksteward.checkpoint.unaligned.task_cut import iter_cut, merge_by_key_group
from sparksteward.errors import CheckpointCorruptError, CheckpointOrderError, ConfigError
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


def _sorted_input(n: int, rows: int = 100, m: int = 16, seed: int = 0) -> list[pa.RecordBatch]:
    """``n`` buffers of one subtask's new input, sorted by key group (as the task sorts it for an
    unaligned state), split at arbitrary points: another seed is another arrival order and chunking."""
    import random

    rnd = random.Random(seed)
    recs = [(f"u{i % 37}", i) for i in range(n * rows)]
    rnd.shuffle(recs)
    recs.sort(key=lambda r: key_group(r[0], m))
    cuts = sorted(rnd.sample(range(1, len(recs)), n - 1))
    out = []
    for a, b in zip([0, *cuts], [*cuts, len(recs)]):
        part = recs[a:b]
        out.append(pa.RecordBatch.from_pydict({"k": [r[0] for r in part], "v": [r[1] for r in part],
                                               "kg": pa.array([key_group(r[0], m) for r in part], pa.int32())}))
    return out


class Cuts:
    """``propose`` as the task's state.cut reaches it: a real coordinator of one subtask over key
    groups [0, 16) records the first proposal of checkpoint 0 and moves it to the end on an overflow."""

    def __init__(self, tmp_path) -> None:
        import uuid

        from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
        from sparksteward.checkpoint.storage import CheckpointStorage

        self.coord = CheckpointCoordinator(CheckpointStorage.open(str(tmp_path / uuid.uuid4().hex), "s"), 1, 16)
        self.coord.begin(0, unaligned=True)   # a cut is recorded in the begun record of its checkpoint
        self.calls: list[tuple[int, bool]] = []

    @property
    def recorded(self) -> Cut | None:
        return self.coord.cut(0, 0)

    def __call__(self, cut: Cut, overflow: bool) -> Cut:
        self.calls.append((cut, overflow))
        return self.coord.amend_cut(0, 0, cut) if overflow else self.coord.cut(0, 0, cut)


def _run(batches, *, cut=None, deadline=None, cuts, writer, counters=None, replayed=()):
    counters = {} if counters is None else counters
    merged = merge_by_key_group(replayed, batches, kg_column="kg", key_groups=lambda b: pa.array(
        [key_group(k, 16) for k in b.column("k").to_pylist()], pa.int32()))
    out = list(iter_cut(merged, kg_column="kg", start=0, stop=16, cut=cut, deadline_passed=deadline,
                        propose=cuts, writer=writer, counters=counters))
    return out, counters


def _rows(batches) -> list[tuple]:
    return sorted(zip(*(pa.Table.from_batches(batches).column(c).to_pylist() for c in ("k", "v")))) if batches else []


def test_every_attempt_cuts_the_same_rows_whatever_the_order_or_timing(tmp_path):
    """A first attempt defers once its timeout passes; a second attempt (another arrival order and
    chunking, another clock) that opens after the cut was recorded processes and defers exactly the
    same rows; one that learns of it later keeps going up to it."""
    cuts = Cuts(tmp_path)
    calls = iter([False, True])   # the deadline passes before the third buffer
    w1 = ChannelStateWriter(tmp_path / "a1")
    out1, c1 = _run(_sorted_input(6, seed=1), deadline=lambda: next(calls, True), cuts=cuts, writer=w1)
    deferred1 = list(read_channel_state(w1.close().path))
    assert cuts.recorded is not None and Cut(0) < cuts.recorded < Cut(16) and c1["unaligned"] == 1
    assert c1["rows_processed"] + c1["rows_deferred"] == 600 and "kg" not in out1[0].schema.names
    w2 = ChannelStateWriter(tmp_path / "a2")   # opened after the cut was recorded: follows it, no clock
    out2, _ = _run(_sorted_input(6, seed=2), cut=cuts.recorded, cuts=cuts, writer=w2)
    assert _rows(out2) == _rows(out1) and _rows(list(read_channel_state(w2.close().path))) == _rows(deferred1)
    w3 = ChannelStateWriter(tmp_path / "a3")   # its own timeout passed at once: it proposed earlier, and goes on
    out3, _ = _run(_sorted_input(6, seed=3), deadline=lambda: True, cuts=cuts, writer=w3)
    assert _rows(out3) == _rows(out1) and _rows(list(read_channel_state(w3.close().path))) == _rows(deferred1)


def test_an_attempt_past_the_recorded_cut_is_discarded_and_one_that_finished_first_records_none(tmp_path):
    cuts = Cuts(tmp_path)
    w = ChannelStateWriter(tmp_path / "a")
    out, c = _run(_sorted_input(6, seed=1), deadline=lambda: False, cuts=cuts, writer=w)   # never late
    assert cuts.recorded == Cut(16) and w.close() is None and c == {"rows_processed": 600, "rows_deferred": 0,
                                                                "unaligned": 0}
    cuts2 = Cuts(tmp_path)
    cuts2(Cut(3), False)   # another attempt cut at key group 3 while this one was processing past it
    with pytest.raises(CheckpointOrderError, match=r"another attempt of this checkpoint cut its input at key "
                                                   r"group 3 \(after 0 of its rows\), but this attempt already "
                                                   r"processed up to key group"):
        _run(_sorted_input(6, seed=1), deadline=lambda: False, cuts=cuts2, writer=ChannelStateWriter(tmp_path / "b"))


def test_a_backlog_is_cut_with_the_new_input_by_key_group_and_keeps_its_place(tmp_path):
    """Replayed rows and new rows are processed in key-group order, the replayed ones first within a
    key group: a cut defers a key's old and new rows together, its old ones ahead, so a straggler
    processes about one timeout's worth of work and never a key's new row before its old one."""
    old = [pa.RecordBatch.from_pydict({"k": [f"u{i % 37}" for i in range(200)], "v": [-1 - i for i in range(200)]})]
    cuts = Cuts(tmp_path)
    calls = iter([False, True])
    w = ChannelStateWriter(tmp_path / "ch")
    out, c = _run(_sorted_input(3, seed=4), deadline=lambda: next(calls, True), cuts=cuts, writer=w, replayed=old)
    cut = cuts.recorded.group
    assert 0 < cut < 16 and c["rows_processed"] + c["rows_deferred"] == 500
    done = pa.Table.from_batches(out)
    assert all(key_group(k, 16) < cut for k in done.column("k").to_pylist())
    deferred = pa.Table.from_batches(list(read_channel_state(w.close().path)))
    assert all(key_group(k, 16) >= cut for k in deferred.column("k").to_pylist())
    assert sorted(done.column("v").to_pylist() + deferred.column("v").to_pylist()) == sorted(
        list(range(-200, 0)) + list(range(300)))
    for table in (done, deferred):   # per key: the old (negative) rows before the new ones
        seen_new: set[str] = set()
        for k, v in zip(table.column("k").to_pylist(), table.column("v").to_pylist()):
            assert not (v < 0 and k in seen_new), k
            if v >= 0:
                seen_new.add(k)
    # timeout 0 still processes one buffer first, so every batch makes progress
    cuts = Cuts(tmp_path)
    out, c = _run(_sorted_input(3, seed=4), deadline=lambda: True, cuts=cuts, writer=ChannelStateWriter(tmp_path / "c2"))
    assert c["rows_processed"] >= 1 and cuts.recorded >= Cut(1)


def test_buffers_are_written_as_they_came_and_pieces_are_joined(tmp_path):
    src = _batches(6)
    w3 = ChannelStateWriter(tmp_path / "ch3")
    for b in [src[0]] + [src[1].slice(i, 10) for i in range(0, 100, 10)]:
        w3.append(b)
    assert [b.num_rows for b in read_channel_state(w3.close().path)] == [100, 100]


def test_max_inflight_moves_the_cut_to_the_end_for_every_attempt_alike(tmp_path):
    """The deferred rows pass the cap by their logical size, which chunking does not change: the first
    attempt to pass it processes everything and moves the cut to the end; the next follows."""
    one = _sorted_input(6, seed=1)
    without_kg = [b.drop_columns(["kg"]) for b in one]
    whole = pa.Table.from_batches(without_kg).combine_chunks().to_batches()[0]
    assert sum(logical_size(b) for b in without_kg) == logical_size(whole)   # chunking changes nothing
    cap = logical_size(whole) // 3
    cuts = Cuts(tmp_path)
    w = ChannelStateWriter(tmp_path / "ch", max_bytes=cap)
    out, c = _run(one, deadline=lambda: True, cuts=cuts, writer=w)
    assert cuts.recorded == Cut(16) and cuts.calls[-1][1] is True and w.close() is None
    assert c == {"rows_processed": 600, "rows_deferred": 0, "unaligned": 0} and len(_rows(out)) == 600
    w2 = ChannelStateWriter(tmp_path / "ch2", max_bytes=cap)
    out2, _ = _run(_sorted_input(6, seed=9), cut=cuts.recorded, cuts=cuts, writer=w2)
    assert _rows(out2) == _rows(out) and w2.close() is None


def test_bad_options_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"aligned_checkpoint_timeout=-1 must be a number of seconds >= 0"):
        AlignmentOptions(alignment="unaligned", aligned_checkpoint_timeout=-1)
    with pytest.raises(ConfigError, match=r"alignment='sideways' is not valid"):
        AlignmentOptions(alignment="sideways")
    with pytest.raises(ConfigError, match=r"max_inflight_bytes=0 must be a positive"):
        AlignmentOptions(max_inflight_bytes=0)


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


def test_a_late_flag_that_is_not_a_boolean_is_named_with_its_file(tmp_path):
    """A channel-state file whose ``__late`` column (the late flag of ``late="keep"``) is not a boolean was
    not written by us: refused naming the file and the column, before any row is replayed."""
    w = ChannelStateWriter(tmp_path / "ch")
    w.append(pa.RecordBatch.from_pydict({"k": ["a"], "__late": ["yes"]}))
    w.close()
    with pytest.raises(CheckpointCorruptError, match=r"channel-state file .*ch has a '__late' column of type string"):
        list(read_channel_state(tmp_path / "ch"))
    w = ChannelStateWriter(tmp_path / "ok")
    w.append(pa.RecordBatch.from_pydict({"k": ["a"], "__late": [True]}))
    w.close()
    assert len(list(read_channel_state(tmp_path / "ok"))) == 1
