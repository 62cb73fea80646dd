"""Typed messages (wire/messages.py): one parse and check at the receiver, errors that name the op and the
field, the same JSON object on the wire, and the registry that servers and clients share."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from sparksteward.errors import InvalidRequestError
from sparksteward.wire import AgentServer, Connection, new_secret
from sparksteward.wire.link import AgentLink
from sparksteward.wire.messages import OPS, Message, ask, flag, integer, nested, op, sequence, text


@dataclass(frozen=True, slots=True)
class EchoReply(Message):
    """What the echo op answers."""

    n: int = integer()
    seen: list[str] = sequence(default=[], of=str)


@dataclass(frozen=True, slots=True)
class Inner(Message):
    done: bool = flag(default=False)


@op("test.echo", reply=EchoReply, repeatable=True)
@dataclass(frozen=True, slots=True)
class EchoRequest(Message):
    """Echo ``n`` back (a test op)."""

    name: str = text(max_len=8)
    n: int = integer(lo=0, hi=100, default=1)
    inner: Inner | None = nested(Inner, default=None)
    tags: list[str] = sequence(default=[], of=str, max_items=3)


def test_a_message_is_the_same_json_object_both_ways():
    req = EchoRequest("a", 3, Inner(True), ["x"])
    assert req.to_wire() == {"name": "a", "n": 3, "inner": {"done": True}, "tags": ["x"]}
    assert EchoRequest.from_wire(req.to_wire()) == req
    assert EchoRequest.from_wire({"name": "a", "op": "test.echo", "unknown": 1}) == EchoRequest("a")
    assert "inner" not in EchoRequest("a").to_wire()   # an optional nested message that is None is left out


@pytest.mark.parametrize("raw, says", [
    ({}, "field 'name' = (missing)"),
    ({"name": "much too long"}, "at most 8 characters"),
    ({"name": "a", "n": 101}, "field 'n' = 101 is not valid: expected an integer from 0 to 100"),
    ({"name": "a", "n": True}, "field 'n' = True"),
    ({"name": "a", "tags": [1]}, "a JSON array of strings"),
    ({"name": "a", "tags": ["a", "b", "c", "d"]}, "at most 3 items"),
    ({"name": "a", "inner": {"done": "yes"}}, "test.echo inner: field 'done'"),
    ({"name": "a", "inner": [1]}, "field 'inner' = [1] is not valid: expected a JSON object"),
])
def test_a_bad_field_is_refused_naming_the_op_the_field_and_what_was_expected(raw, says):
    with pytest.raises(InvalidRequestError, match="test.echo") as info:
        EchoRequest.from_wire(raw)
    assert says in str(info.value)


def test_the_registry_names_each_op_once_with_its_classes():
    assert OPS["test.echo"].request is EchoRequest and OPS["test.echo"].reply is EchoReply
    assert OPS["test.echo"].repeatable and OPS["test.echo"].doc == "Echo ``n`` back (a test op)."
    with pytest.raises(RuntimeError, match="declared twice"):
        op("test.echo", reply=EchoReply)(Inner)


def test_a_server_parses_once_and_a_client_gets_the_typed_reply():
    got: list[EchoRequest] = []

    def handle(conn, req: EchoRequest) -> EchoReply:
        got.append(req)
        return EchoReply(n=req.n * 2, seen=list(req.tags))

    secret = new_secret()
    with AgentServer("127.0.0.1", 0, secret, {}, timeout=30) as srv:
        srv.serve(EchoRequest, handle)
        link = AgentLink(srv.endpoint, secret)
        try:
            assert link.ask(EchoRequest("a", 4, tags=["t"])) == EchoReply(8, ["t"])
            with Connection.connect(srv.endpoint, secret) as conn:
                assert ask(conn, EchoRequest("b")).n == 2
                # a peer that sends a bad field gets the receiver's one check, by name; the handler never runs
                with pytest.raises(InvalidRequestError, match="field 'n' = -1"):
                    conn.call("test.echo", {"name": "c", "n": -1})
        finally:
            link.close()
    assert [r.name for r in got] == ["a", "b"]


def test_an_unregistered_request_class_cannot_be_served():
    with AgentServer("127.0.0.1", 0, new_secret(), {}, timeout=30) as srv, pytest.raises(RuntimeError):
        srv.serve(Inner, lambda conn, req: None)
