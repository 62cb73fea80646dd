"""The typed messages of a keyed state's life on the driver agent (checkpoint/lifecycle_messages.py): the
JSON each sends is the one the ops sent before them, and the receiver's one check refuses by name."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.lifecycle_messages import (
    BatchTime,
    BeginReply,
    BeginRequest,
    CheckReply,
    CheckRequest,
    CommitRequest,
    RegisterRequest,
)
from sparksteward.errors import CheckpointError, InvalidRequestError
from sparksteward.wire.messages import MAX_PARALLELISM, OPS


def test_the_state_ops_are_registered_and_never_sent_twice():
    for name in ("state.register", "state.check", "state.begin", "state.commit", "state.abort", "state.info",
                 "state.savepoint"):
        assert OPS[name].served_by == "driver" and not OPS[name].repeatable   # none is sent twice (client.repeatable)


def test_a_check_reply_leaves_out_what_its_kind_never_had():
    where = {"checkpoint_dir": "/c", "cluster_id": "c1"}
    registered = CheckReply(registered=True, last_completed=None, key_type="string", latest=None, states=None, **where)
    assert registered.to_wire() == {"registered": True, "last_completed": None, "key_type": "string", "latest": None,
                                    "states": None, **where}
    nothing = CheckReply(registered=False, restore_from=None, states=None, **where)
    assert nothing.to_wire() == {"registered": False, "last_completed": None, "restore_from": None, "states": None,
                                 **where}
    source = CheckReply(registered=False, restore_from="claim", checkpoint_id=4, key_type="long", **where)
    assert source.to_wire() == {"registered": False, "last_completed": None, "restore_from": "claim",
                                "checkpoint_id": 4, "key_type": "long", "states": None, **where}
    for reply in (registered, nothing, source):
        assert CheckReply.from_wire(reply.to_wire()) == reply


def test_a_begin_reply_of_a_drain_with_nothing_to_drain_is_three_fields():
    assert BeginReply(checkpoint_id=None).to_wire() == {"checkpoint_id": None, "rerun": False, "unaligned": False}
    begun = BeginReply(checkpoint_id=3, attempt="a1", time=BatchTime(1000), states={"variables": {}})
    assert begun.to_wire() == {"checkpoint_id": 3, "rerun": False, "unaligned": False, "backlog_warning": None,
                               "attempt": "a1", "time": {"processing_ms": 1000}, "states": {"variables": {}},
                               "empty": False}
    assert BeginReply.from_wire(begun.to_wire()) == begun


def test_requests_carry_the_fields_the_driver_sent_before():
    begin = BeginRequest(name="s", checkpoint_id=None, batch_id=2, parallelism=4, query=None, drain=False)
    assert begin.to_wire() == {"name": "s", "parallelism": 4, "query": None, "batch_id": 2, "drain": False,
                               "timers": False, "checkpoint_id": None}   # no alignment: only a caller that overrides it sends it
    commit = CommitRequest(name="s", checkpoint_id=3, wait=None)
    assert commit.to_wire() == {"name": "s", "wait": None, "checkpoint_id": 3}   # the client's timeout sees "wait"


@pytest.mark.parametrize("raw, error, says", [
    ({"name": "a/b", "max_parallelism": 8}, InvalidRequestError, "state name 'a/b' is not valid"),
    ({"name": "s", "max_parallelism": MAX_PARALLELISM + 1}, InvalidRequestError,
     f"state.check: field 'max_parallelism' = {MAX_PARALLELISM + 1}"),
    ({"name": "s", "max_parallelism": 8, "claim_mode": "grab"}, CheckpointError, "claim_mode='grab' is not valid"),
    ({"name": "s", "max_parallelism": 8, "states": ["v"]}, InvalidRequestError,
     "state.check: field 'states' must be an array of state declarations"),
    ({"name": "s", "max_parallelism": 8, "claimed_roots": [""]}, InvalidRequestError,
     "state.check: field 'claimed_roots' must be an array of URLs or paths"),
    ({"name": "s", "max_parallelism": 8, "delete_states": [1]}, InvalidRequestError,
     "state.check: field 'delete_states' must be an array of state variable names"),
])
def test_an_open_request_is_refused_by_name(raw, error, says):
    with pytest.raises(error) as info:
        CheckRequest.from_wire(raw)
    assert says in str(info.value)


def test_a_register_names_the_settings_a_check_does_not():
    with pytest.raises(InvalidRequestError, match="state.register: field 'parallelism' = \\(missing\\)"):
        RegisterRequest.from_wire({"name": "s", "max_parallelism": 8, "key_type": "string"})
    reg = RegisterRequest.from_wire({"name": "s", "parallelism": 2, "max_parallelism": 8, "key_type": "string"})
    assert (reg.num_retained, reg.key, reg.checkpoint_dir, reg.claimed_roots) == (1, "", None, None)
