"""Task counters and subtask stats are typed end to end (checkpoint/messages.py): every field a task sends
(:class:`TaskCounters`) and every field the executor agent adds (:class:`SubtaskStats`) reaches the
checkpoint's summed stats (:func:`summarize`, what ``KeyedState.commit``, ``ks.info()`` and the report
show); a field nobody reads fails the check; ``ttl_sweep_ms`` and ``channel_bytes`` reach the stats, the
report and the metrics. No Spark."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import orjson
from sparksteward.checkpoint.coordination.report import checkpoint_report
from sparksteward.checkpoint.coordination.stats import LARGEST, PER_SUBTASK, SMALLEST, SubtaskStats, summarize
from sparksteward.checkpoint.messages import (
    AckRequest,
    OpenReply,
    OpenRequest,
    TaskCounters,
    UploadRequest,
)
from sparksteward.checkpoint.records import SubtaskHandle
from sparksteward.state.backend import RocksDBStateBackend
from sparksteward.state.keygroups import KeyGroupRange, key_group_range
from sparksteward.wire.messages import ask, integer, number

from tests.helpers.state import state_agents

P, M = 2, 8
SUBTASKS = (0, 1)


def _marker(kind: Any, index: int, subtask: int) -> Any:
    """A value of type ``kind`` that no other field or subtask has (and whose sums do not collide)."""
    n = 1_000_003 * (index + 1) + 101 * (subtask + 1)
    args = typing.get_args(kind) or (kind,)
    if int in args:
        return n
    if float in args:
        return n + 0.5
    if dict in args or typing.get_origin(args[0]) is dict:
        return {"marker": n}
    raise AssertionError(f"no marker for a field of type {kind}")


def _leaves(value: Any) -> list[Any]:
    """Every number and string inside ``value`` (a summary: dicts and lists of them)."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in _leaves(v)]
    if isinstance(value, list):
        return [x for v in value for x in _leaves(v)]
    return [value]


def _through_the_wire(counters: TaskCounters, subtask: int, measured: dict[str, Any]) -> SubtaskStats:
    """What happens to one task's counters: the worker sends them with state.upload, the executor agent
    parses them, extends them with its measurements and acks, the driver agent parses the ack."""
    upload = UploadRequest.from_wire(orjson.loads(orjson.dumps(UploadRequest("t", 1.0, 0.5, counters).to_wire())))
    stats = SubtaskStats.of(upload.counters, **measured)
    handle = SubtaskHandle(subtask, KeyGroupRange(subtask, subtask + 1), ())
    ack = AckRequest("s", 3, handle, "a" * 32, [], [], "agent", stats)
    got = AckRequest.from_wire(orjson.loads(orjson.dumps(ack.to_wire()))).stats
    assert got is not None
    return got


def unread(counters_cls: type[TaskCounters] = TaskCounters,
           stats_cls: type[SubtaskStats] = SubtaskStats) -> list[str]:
    """The fields of ``counters_cls`` (sent by the task) and of ``stats_cls`` (added by the executor
    agent) whose values do not reach the checkpoint's summed stats. Every field gets a distinct value
    per subtask; a number arrives as the subtasks' sum, as each subtask's value, or as their maximum or
    minimum; a
    flag set on one subtask changes the summary."""
    hints = typing.get_type_hints(stats_cls) | typing.get_type_hints(counters_cls)
    names = list(dict.fromkeys([f.name for f in dataclasses.fields(counters_cls)] +
                               [f.name for f in dataclasses.fields(stats_cls)]))
    counter_names = {f.name for f in dataclasses.fields(counters_cls)}
    wire_names = {f.name for f in dataclasses.fields(SubtaskStats)}   # what the ack carries
    flags = [n for n in names if hints[n] is bool]
    markers = {s: {n: _marker(hints[n], i, s) for i, n in enumerate(names) if n not in flags} for s in SUBTASKS}

    def summary(flagged: str | None) -> dict[str, Any]:
        acks = {}
        for s in SUBTASKS:
            values = {**markers[s], **{n: s == 1 and n == flagged for n in flags}}
            counters = counters_cls(**{n: v for n, v in values.items() if n in counter_names})
            measured = {n: v for n, v in values.items() if n not in counter_names and n in wire_names}
            stats = _through_the_wire(counters, s, measured)
            if stats_cls is not SubtaskStats:   # a stats class with more fields, given to summarize directly
                stats = stats_cls(**{n: getattr(stats, n) for n in wire_names},
                                  **{n: v for n, v in values.items() if n not in counter_names | wire_names})
            acks[s] = stats
        return summarize(3, acks)

    plain = summary(None)
    leaves = _leaves(plain)
    missing = []
    for name in names:
        if name in flags:
            if summary(name) == plain:
                missing.append(name)
            continue
        a, b = markers[0][name], markers[1][name]
        if isinstance(a, dict):
            arrived = a in leaves or a["marker"] in leaves and b["marker"] in leaves
        else:
            arrived = a + b in leaves or (a in leaves and b in leaves) or max(a, b) in leaves or min(a, b) in leaves
        if not arrived:
            missing.append(name)
    return missing


# --- (a) every field reaches the checkpoint's stats -------------------------------------------------
def test_every_field_a_task_sends_or_the_executor_agent_adds_reaches_the_checkpoints_stats():
    assert unread() == []


def test_each_task_counter_is_summed_or_listed_per_subtask_under_its_own_name():
    """Besides arriving somewhere: a counter is found under its own name, summed (or per subtask, or
    its largest)."""
    counters = [TaskCounters(**{f.name: 10 * (i + 1) + s for i, f in enumerate(dataclasses.fields(TaskCounters))
                                if f.name != "unaligned"}, unaligned=s == 1) for s in SUBTASKS]
    acks = {s: _through_the_wire(c, s, {}) for s, c in zip(SUBTASKS, counters)}
    got = summarize(3, acks)
    for f in dataclasses.fields(TaskCounters):
        values = [getattr(c, f.name) for c in counters]
        if f.name == "unaligned":
            assert got["unaligned_subtasks"] == [1]
        elif f.name in PER_SUBTASK:
            assert got[f.name] == values, f.name
        elif f.name in LARGEST:
            assert got[f.name] == max(values), f.name
        elif f.name in SMALLEST:
            assert got[f.name] == min(values), f.name
        else:
            assert got[f.name] == sum(values), f.name


# --- (b) a field nobody reads fails it ----------------------------------------------------------------
def test_a_counter_the_wire_drops_fails_the_check():
    """A task that counts a field the counters message does not declare: state.upload parses the
    declared TaskCounters, so the value is dropped on the way, and the check names it."""
    extended = dataclasses.make_dataclass(
        "ExtendedCounters", [("mystery_rows", int, integer(default=0, lo=0))], bases=(TaskCounters,),
        frozen=True, slots=True)
    assert unread(counters_cls=extended) == ["mystery_rows"]


def test_a_stats_field_that_summarize_does_not_read_fails_the_check():
    """A field of the ack's stats that the checkpoint's sum leaves out is named."""
    extended = dataclasses.make_dataclass(
        "ExtendedStats", [("mystery_ms", float, number(default=0.0, lo=0))], bases=(SubtaskStats,),
        frozen=True, slots=True)
    assert unread(stats_cls=extended) == ["mystery_ms"]


# --- ttl_sweep_ms and channel_bytes: stats, report and metrics ----------------------------------------
def test_ttl_sweep_ms_and_channel_bytes_reach_the_stats_the_report_and_the_metrics():
    acks = {s: _through_the_wire(TaskCounters(ttl_sweep_ms=7 + 5 * s, channel_bytes=100 + s), s, {})
            for s in SUBTASKS}
    summary = summarize(3, acks)
    assert summary["ttl_sweep_ms"] == [7, 12] and summary["channel_bytes"] == 201
    report = checkpoint_report("s", summary, parallelism=P)
    assert report.gauges()["state.s.checkpoint.ttl_sweep_ms"] == 12   # the slowest subtask's sweep
    assert report.gauges()["state.s.checkpoint.channel_bytes"] == 201


def test_a_tasks_counters_reach_commit_info_and_the_metrics_over_real_agents(tmp_path):
    """The worker's typed state.open and state.upload (as keyed_tasks sends them) on a real executor
    agent, acked to a real driver agent: the commit's stats and report, state.info's checkpoints and
    the driver agent's metrics."""
    with state_agents(tmp_path, P, M) as (dconn, econn, _, states):
        dconn.request("state.begin", name="s", checkpoint_id=0)
        for subtask in range(P):
            opened: OpenReply = ask(econn, OpenRequest("s", 0, subtask, P))
            backend = RocksDBStateBackend(opened.workdir, key_group_range(M, P, subtask), M, "string",
                                          create=False)
            try:
                snap = backend.snapshot(opened.snapshot)
            finally:
                backend.close()
            counters = TaskCounters.counted({"rows_processed": 3, "ttl_expired_removed": 2, "wal_bytes": 9,
                                             "ttl_sweep_ms": 4 + subtask, "channel_bytes": 50 * (subtask + 1),
                                             "unaligned": 1})
            ask(econn, UploadRequest(opened.token, snap.sync_ms, snap.flush_ms, counters))
        reply = dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)
        info = dconn.request("state.info", name="s")
        metrics = states.metrics()
    stats = reply["stats"]
    assert stats["ttl_sweep_ms"] == [4, 5] and stats["channel_bytes"] == 150 and stats["wal_bytes"] == 18
    assert stats["ttl_expired_removed"] == 4 and stats["rows_processed"] == 6 and stats["unaligned_subtasks"] == [0, 1]
    assert info["checkpoints"][-1]["ttl_sweep_ms"] == [4, 5] and info["checkpoints"][-1]["channel_bytes"] == 150
    assert reply["report"]["ttl_sweep_ms"] == 5 and reply["report"]["channel_bytes"] == 150
    assert metrics["state.s.checkpoint.ttl_sweep_ms"] == 5 and metrics["state.s.checkpoint.channel_bytes"] == 150
    assert metrics["state.s.unaligned.channel_bytes"] == 150
