"""The executor agents' ops on the driver agent (checkpoint/coordination/gateway.py), over real sockets without
Spark: the base of an attempt crosses the wire once per executor agent, and a new attempt sends it
again."""

from __future__ import annotations

from collections import Counter

import orjson
import pytest
from sparksteward.checkpoint.messages import BaseReply
from sparksteward.errors import InvalidRecordError

from tests.helpers.merging import MergingRig
from tests.helpers.state import split_by_subtask


def _keys(n: int, start: int = 0) -> dict[str, int]:
    return {f"k{i}": i for i in range(start, start + n)}


def _sum(*deltas: dict[str, int]) -> dict[str, int]:
    out: Counter[str] = Counter()
    for d in deltas:
        out.update(d)
    return dict(out)


def _latest(rig: MergingRig) -> dict[str, int]:
    return rig.values(rig.storage.read_metadata(max(rig.storage.checkpoint_ids())))


@pytest.mark.parametrize("executors", [1, 2])
def test_the_base_of_an_attempt_is_sent_once_per_executor_agent(tmp_path, executors):
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=4, executors=executors)
    try:
        sent = rig.states.gateway.bases_sent
        for cid in range(3):
            before = dict(sent)
            rig.batch(cid, _keys(40, start=cid * 10))
            full = sent["full"] - before.get("full", 0)
            same = sent["same"] - before.get("same", 0)
            assert (full, same) == (executors, 4 - executors), f"checkpoint {cid}: {dict(sent)}"
        assert _latest(rig) == _sum(_keys(40), _keys(40, 10), _keys(40, 20))
    finally:
        rig.close()


def test_a_new_attempt_sends_the_base_again(tmp_path):
    """The driver begins checkpoint 1 again after a subtask opened: the agent holds the replaced
    attempt's base, so the next open gets the full base of the new attempt, and the checkpoint
    completes from it."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=2, executors=1)
    try:
        rig.batch(0, _keys(20))
        delta = _keys(20, 5)
        rig.dconn.request("state.begin", name=rig.name, checkpoint_id=1)
        rig.task(1, 0, split_by_subtask(delta, 2, 64)[0])
        before = dict(rig.states.gateway.bases_sent)
        rig.dconn.request("state.begin", name=rig.name, checkpoint_id=1)   # a new attempt
        for i, part in enumerate(split_by_subtask(delta, 2, 64)):
            rig.task(1, i, part)
        rig.dconn.request("state.commit", name=rig.name, checkpoint_id=1, wait=60)
        sent = rig.states.gateway.bases_sent
        assert (sent["full"] - before["full"], sent["same"] - before["same"]) == (1, 1)
        assert _latest(rig) == _sum(_keys(20), delta)
    finally:
        rig.close()


def test_a_reply_without_the_base_is_refused_when_the_agent_does_not_hold_it():
    reply = {"checkpoint_id": 3, "attempt": "a" * 32, "rerun": False, "checkpoint_dir": "/x", "cluster_id": "c",
             "parallelism": 2, "max_parallelism": 8, "key_type": "string", "merging": {}, "alignment": {},
             "deadline_in": None, "cut": None, "same_base": True}
    with pytest.raises(InvalidRecordError, match="left out the base of checkpoint 3"):
        BaseReply.from_reply(reply, None)
    held = BaseReply.from_reply({**reply, "same_base": False, "attempt": "b" * 32, "base": None, "known": {}})
    with pytest.raises(InvalidRecordError, match="does not hold"):
        BaseReply.from_reply(reply, held)
    assert BaseReply.from_reply({**reply, "attempt": "b" * 32}, held).known == {}


def test_a_reply_without_the_base_is_a_small_fraction_of_a_full_one(tmp_path):
    """What docs/architecture.md quotes: at P=8 after four batches of 2,000 keys, a full state.base
    reply against one that leaves the base out (the agent holds it)."""
    rig = MergingRig(tmp_path, str(tmp_path / "chk"), parallelism=8, executors=2)
    try:
        for cid in range(4):
            rig.batch(cid, {f"k{i}": 1 for i in range(cid * 500, cid * 500 + 2000)})
        rig.dconn.request("state.begin", name=rig.name, checkpoint_id=4)
        full = rig.dconn.request("state.base", name=rig.name, checkpoint_id=4, subtask=0, agent="a")
        short = rig.dconn.request("state.base", name=rig.name, checkpoint_id=4, subtask=1, agent="a",
                                  have=full["attempt"])
        sizes = len(orjson.dumps(full)), len(orjson.dumps(short))
        print(f"state.base reply at P=8: {sizes[0]} B with the base, {sizes[1]} B without")
        assert "base" not in short and short["same_base"] and short["attempt"] == full["attempt"]
        assert sizes[1] < 1000 and sizes[0] > 20 * sizes[1]
    finally:
        rig.close()


@pytest.mark.parametrize("known", [{"c": "shared/c"}, {"c": ["shared/c"]}, {"c": ["shared/c", -1]},
                                   {"c": [7, 0]}, {"c": ["shared/c", True]}])
def test_a_malformed_known_file_in_a_base_reply_is_refused_by_name(known):
    reply = {"checkpoint_id": 3, "attempt": "a" * 32, "rerun": False, "checkpoint_dir": "/x", "cluster_id": "c",
             "parallelism": 2, "max_parallelism": 8, "key_type": "string", "merging": {}, "alignment": {},
             "base": None, "known": known}
    with pytest.raises(InvalidRecordError, match="lists known file 'c' as .*not \\[path, offset\\]"):
        BaseReply.from_reply(reply)
