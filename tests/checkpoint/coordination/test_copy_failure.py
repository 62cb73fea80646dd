"""A failed copy of a subtask aborts its checkpoint only when no other copy can still ack (issue 35
item 7), with a real driver agent and a real executor agent over their sockets: a speculative copy
whose upload fails must not abort a batch whose other copy is still running, on the same agent or on
another; with no other copy the failure aborts at once, as before."""

from __future__ import annotations

import time

import pytest
from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
from sparksteward.errors import CheckpointError

from tests.helpers.state import split_by_subtask, state_agents, write_subtask

pytestmark = pytest.mark.usefixtures("guarded_rmtree")

P, M = 2, 8
KEYS = {f"k{i}": i for i in range(10)}


@pytest.fixture()
def rig(tmp_path):
    with state_agents(tmp_path, P, M, agent_timeout=3.0, merging=MergingOptions(enabled=True)) as (d, e, sub, _):
        yield d, e, sub


def _fail(dconn, opened, agent: str, others: int) -> None:
    """What an executor agent reports when a copy's upload failed (``others``: copies of the same
    subtask still open or uploading there)."""
    assert dconn.request("state.fail", name="s", checkpoint_id=0, subtask=1, message="OSError: upload failed",
                         attempt=opened["attempt"], agent=agent, others=others)["ignored"] is False


def test_a_failed_copy_with_another_copy_on_its_agent_does_not_abort(rig):
    dconn, econn, subtasks = rig
    parts = split_by_subtask(KEYS, P, M)
    dconn.request("state.begin", name="s", checkpoint_id=0)
    write_subtask(econn, econn.request("state.open", name="s", checkpoint_id=0, subtask=0), 0, P, M, parts[0])
    speculative = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
    original = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
    econn.request("state.release", token=speculative["token"])
    _fail(dconn, speculative, subtasks.agent_id, others=1)   # the speculative copy's upload failed
    time.sleep(1.5)                                           # the original is slow, then acks
    write_subtask(econn, original, 1, P, M, parts[1])
    assert dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)["checkpoint_id"] == 0


def test_a_failed_copy_waits_for_a_copy_on_another_agent_until_that_agent_goes_silent(rig):
    dconn, econn, subtasks = rig
    parts = split_by_subtask(KEYS, P, M)
    dconn.request("state.begin", name="s", checkpoint_id=0)
    write_subtask(econn, econn.request("state.open", name="s", checkpoint_id=0, subtask=0), 0, P, M, parts[0])
    mine = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
    econn.request("state.release", token=mine["token"])
    # a copy of subtask 1 on another host: its agent's heartbeat says it works on it
    dconn.request("state.merge_poll", agent="other-host/1/abcdef", wait=0,
                  working=[{"name": "s", "checkpoint_id": 0, "subtask": 1}])
    _fail(dconn, mine, subtasks.agent_id, others=0)   # this agent's copy failed; the other may still ack
    started = time.monotonic()
    # the other host then says nothing more (its copy was killed): the failure dooms the attempt once
    # that agent has been silent for the agent timeout (3 s here), not before
    with pytest.raises(CheckpointError, match="uploads failed"):
        dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)
    assert 1.5 < time.monotonic() - started < 10


def test_a_failed_copy_with_no_other_copy_aborts_at_once(rig):
    dconn, econn, subtasks = rig
    parts = split_by_subtask(KEYS, P, M)
    dconn.request("state.begin", name="s", checkpoint_id=0)
    write_subtask(econn, econn.request("state.open", name="s", checkpoint_id=0, subtask=0), 0, P, M, parts[0])
    only = econn.request("state.open", name="s", checkpoint_id=0, subtask=1)
    econn.request("state.release", token=only["token"])
    _fail(dconn, only, subtasks.agent_id, others=0)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="uploads failed"):
        dconn.request("state.commit", name="s", checkpoint_id=0, wait=30)
    assert time.monotonic() - started < 2.0
