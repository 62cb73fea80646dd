"""Typed messages: one frozen dataclass per request and per reply of every op, and the one registry of
ops that servers and clients share.

A request class names its op and its reply class with :func:`op`::

    @dataclass(frozen=True, slots=True)
    class AckReply(Message):
        done: bool = flag(default=False)

    @op("state.ack", reply=AckReply)
    @dataclass(frozen=True, slots=True)
    class AckRequest(Message):
        name: str = text(max_len=200)
        checkpoint_id: int = integer(lo=0, hi=MAX_CHECKPOINT_ID)

The sender builds the object and sends ``to_wire()``; the receiver parses once with ``from_wire``, which
checks every field's type and bounds and raises :class:`~sparksteward.errors.InvalidRequestError`
naming the op, the field, the value and what was expected (the checks of
:class:`~sparksteward.wire.fields.Fields`). A server registers ``handler(conn, AckRequest) -> AckReply``
with :meth:`AgentServer.serve <sparksteward.wire.server.AgentServer.serve>`; a client sends with
:func:`ask` (one :class:`~sparksteward.wire.connection.Connection`) or
:meth:`AgentLink.ask <sparksteward.wire.link.AgentLink.ask>` and gets the reply class back.

The wire format does not change: a message is the same JSON object the ops sent before (version 2 of
``docs/protocol.md``). Unknown fields are ignored, so an older peer's extra field does not fail a request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from sparksteward.errors import InvalidRequestError
from sparksteward.wire.fields import _REQUIRED, Fields

__all__ = ["MAX_CHECKPOINT_ID", "MAX_PARALLELISM", "Message", "OPS", "Op", "ask", "custom", "flag",
           "integer", "job_id", "mapping", "message_list", "nested", "number", "op", "read_reply", "sequence", "text"]

#: The largest max parallelism a state may have (Flink's UPPER_BOUND_MAX_PARALLELISM: a key group fits
#: two bytes); every parallelism, subtask and key group a request names is below or at it.
MAX_PARALLELISM = 1 << 15
#: The largest checkpoint id a request may name.
MAX_CHECKPOINT_ID = 1 << 62

M = TypeVar("M", bound="Message")
Parse = Callable[[Fields, str], Any]


@dataclass(frozen=True, slots=True)
class _Spec:
    parse: Parse
    dump: Callable[[Any], Any] | None = None   # None: the value is sent as it is
    omit_none: bool = False                      # a None value is left out of the JSON object
    default: Any = _REQUIRED
    #: a Python expression over the raw value ``v`` (never None) that is true when ``v`` is taken as it is,
    #: with no call: the common case of a well-formed message. Anything else goes through ``parse``, which
    #: converts it or raises naming the field. "": always ``parse``.
    fast: str = ""
    null: bool = False   # a null that is present is the value None (a missing field still goes to ``parse``)
    convert: Callable[[Any], Any] | None = None   # applied to a value that passed ``fast``


def _field(parse: Parse, default: Any, *, dump: Callable[[Any], Any] | None = None, omit_none: bool = False,
           fast: str = "", null: bool = False, convert: Callable[[Any], Any] | None = None) -> Any:
    spec = _Spec(parse, dump, omit_none, default, fast, null, convert)
    if default is _REQUIRED:
        return dataclasses.field(metadata={"wire": spec})
    if isinstance(default, (dict, list)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"wire": spec})
    return dataclasses.field(default=default, metadata={"wire": spec})


def _or(default: Any, value: Any) -> Any:
    """A field with a default reads a missing or null value as the default."""
    return default if value is None else value


def text(*, default: Any = _REQUIRED, max_len: int = 1 << 16, choices: tuple[str, ...] = (),
         omit_none: bool = False) -> Any:
    """A string of at most ``max_len`` characters (one of ``choices`` when given). ``omit_none`` (with
    every field function that takes it): a None value is left out of the JSON object."""
    fast = f"type(v) is str and len(v) <= {max_len}" + (f" and v in {choices!r}" if choices else "")
    return _field(lambda f, n: _or(default, f.text(n, default=default, max_len=max_len, choices=choices)), default,
                  omit_none=omit_none, fast=fast)


def flag(*, default: Any = _REQUIRED) -> Any:
    """A JSON boolean."""
    return _field(lambda f, n: f.flag(n, default=default), default, fast="(v is True or v is False)")


def integer(*, default: Any = _REQUIRED, lo: int | None = None, hi: int | None = None, omit_none: bool = False) -> Any:
    """An integer within ``[lo, hi]``."""
    fast = "type(v) is int" + ("" if lo is None else f" and v >= {lo!r}") + ("" if hi is None else f" and v <= {hi!r}")
    return _field(lambda f, n: f.integer(n, default=default, lo=lo, hi=hi), default, omit_none=omit_none, fast=fast)


def number(*, default: Any = _REQUIRED, lo: float | None = None, hi: float | None = None) -> Any:
    """A finite number within ``[lo, hi]``, read as a float."""
    return _field(lambda f, n: f.number(n, default=default, lo=lo, hi=hi), default)


def mapping(*, default: Any = _REQUIRED, omit_none: bool = False) -> Any:
    """A JSON object, passed as it is (the handler checks what is inside)."""
    return _field(lambda f, n: _or(default, f.mapping(n, default=default)), default, omit_none=omit_none,
                  fast="type(v) is dict")


def sequence(*, default: Any = _REQUIRED, max_items: int = 1024, of: type | tuple[type, ...] | None = None,
             omit_none: bool = False) -> Any:
    """A JSON array of at most ``max_items`` items, each of type ``of`` when given."""
    def parse(f: Fields, n: str) -> Any:
        value = f.sequence(n, default=default, max_items=max_items)
        if value is None:
            return default
        if of is not None and not all(isinstance(v, of) and not isinstance(v, bool) for v in value):
            f._bad(n, value, f"a JSON array of {_kind(of)}")
        return value
    return _field(parse, default, omit_none=omit_none,
                  fast="" if of is not None else f"type(v) is list and len(v) <= {max_items}")


def job_id(*, nullable: bool = False) -> Any:
    """A job id, validated; present, and null only if ``nullable``."""
    return _field(lambda f, n: f.job_id(n, nullable=nullable), _REQUIRED, null=nullable)


def nested(cls: type[Message], *, default: Any = _REQUIRED) -> Any:
    """A message inside a message (a JSON object), parsed with ``cls.from_wire``."""
    def parse(f: Fields, n: str) -> Any:
        value = f.mapping(n, default=default)
        return value if value is default else cls.from_wire(value, f"{f.op} {n}")
    return _field(parse, default, dump=lambda v: v.to_wire(), omit_none=default is None)


def message_list(cls: type[Message], *, max_items: int = 100_000, required: bool = False) -> Any:
    """A JSON array of at most ``max_items`` messages ``cls`` (empty when missing, unless ``required``)."""
    def parse(f: Fields, n: str) -> Any:
        items = f.sequence(n, max_items=max_items) if required else f.sequence(n, default=[], max_items=max_items)
        return [cls.from_wire(item, f"{f.op} {n}") for item in items]

    def dump(items: list[Message]) -> list[dict[str, Any]]:
        return [m.to_wire() for m in items]
    return _field(parse, _REQUIRED if required else [], dump=dump)


def custom(parse: Parse, dump: Callable[[Any], Any] | None = None, *, default: Any = _REQUIRED,
           omit_none: bool = False, fast: str = "", convert: Callable[[Any], Any] | None = None) -> Any:
    """A field read by ``parse(fields, name)`` (which raises by name on a bad value) and written by ``dump``.
    ``fast`` and ``convert``, for a field on a hot path: a raw value ``v`` for which the expression ``fast``
    holds is read as ``convert(v)``, which must give what ``parse`` would."""
    return _field(parse, default, dump=dump, omit_none=omit_none, fast=fast, convert=convert)


def _kind(of: type | tuple[type, ...]) -> str:
    names = {str: "strings", int: "integers", float: "numbers", dict: "JSON objects", list: "arrays"}
    types = of if isinstance(of, tuple) else (of,)
    return " or ".join(names.get(t, t.__name__) for t in types)


@dataclass(frozen=True, slots=True)
class _Codec:
    """A message class's ``to_wire`` and ``from_wire``, generated once per class from its fields' specs:
    straight-line code with the common case inline (a message is parsed and built on every request)."""

    to_wire: Callable[[Any], dict[str, Any]]
    from_wire: Callable[[type, dict[str, Any], str | None], Any]


_CODECS: dict[type, _Codec] = {}


def _fields_of(raw: dict[str, Any], op: str) -> Fields:
    f = Fields(raw)
    f.op = op   # errors name the op, whatever the peer put in "op"
    return f


def _codec(cls: type) -> _Codec:
    """The generated codec of ``cls`` (a field's ``fast`` test is a constant expression built by this
    module's field functions from their own bounds, never from a message's data)."""
    codec = _CODECS.get(cls)
    if codec is not None:
        return codec
    env: dict[str, Any] = {"cls": cls, "_fields_of": _fields_of, "_codec": _codec, "_not_an_object": _not_an_object}
    # installed on the class itself (below), so a subclass that inherits them hands over to its own codec
    dump_lines = ["def to_wire(self):",
                  "    if self.__class__ is not cls: return _codec(self.__class__).to_wire(self)",
                  "    out = {}"]
    parse_lines = ["def from_wire(klass, raw, op=None):",
                   "    if klass is not cls: return _codec(klass).from_wire(klass, raw, op)",
                   "    if type(raw) is not dict: _not_an_object(cls, raw, op)",
                   "    op = op or cls.OP or cls.__name__",
                   "    f = None"]
    args = []
    for i, fld in enumerate(dataclasses.fields(cls)):
        spec: _Spec | None = fld.metadata.get("wire")
        if spec is None:
            continue
        name = fld.name
        env[f"P{i}"], env[f"D{i}"], env[f"X{i}"], env[f"C{i}"] = spec.parse, spec.default, spec.dump, spec.convert
        dumped = f"X{i}(v)" if spec.dump is not None else "v"
        dump_lines.append(f"    v = self.{name}")
        if spec.omit_none:
            dump_lines.append(f"    if v is not None: out[{name!r}] = {dumped}")
        elif spec.dump is not None:
            dump_lines.append(f"    out[{name!r}] = None if v is None else {dumped}")
        else:
            dump_lines.append(f"    out[{name!r}] = v")
        slow = ["        if f is None: f = _fields_of(raw, op)", f"        v = P{i}(f, {name!r})"]
        parse_lines.append(f"    v = raw.get({name!r})")
        if spec.default is not _REQUIRED and spec.fast:
            copy = f"type(D{i})(D{i})" if isinstance(spec.default, (dict, list)) else f"D{i}"
            parse_lines += [f"    if v is None: v = {copy}", f"    elif not ({spec.fast}):", *slow]
        elif spec.null:
            parse_lines += [f"    if v is None and {name!r} in raw: pass",
                            f"    elif {'v is None or not (' + spec.fast + ')' if spec.fast else 'True'}:", *slow]
        elif spec.fast:
            parse_lines += [f"    if v is None or not ({spec.fast}):", *slow]
        else:
            parse_lines += ["    if True:", *slow]
        if spec.convert is not None and spec.fast:
            parse_lines.append(f"    else: v = C{i}(v)")
        parse_lines.append(f"    a{i} = v")
        args.append(f"{name}=a{i}")
    dump_lines.append("    return out")
    every = [f for f in dataclasses.fields(cls) if f.init]
    if len(args) == len(every) and all(f.metadata.get("wire") is not None and not f.kw_only for f in every):
        args = [a.split("=", 1)[1] for a in args]   # every field, in order: positional is cheaper
    parse_lines.append(f"    return cls({', '.join(args)})")
    exec(compile("\n".join(dump_lines + parse_lines), f"<codec of {cls.__qualname__}>", "exec"), env)  # noqa: S102
    codec = _CODECS[cls] = _Codec(env["to_wire"], env["from_wire"])
    if "to_wire" not in cls.__dict__:   # a class that writes itself (a reply with a legacy shape) keeps its own
        setattr(cls, "to_wire", codec.to_wire)  # noqa: B010  (an attribute of the class, not of its instances)
    setattr(cls, "from_wire", classmethod(codec.from_wire))  # noqa: B010
    return codec


def _not_an_object(cls: type, raw: object, op: str | None) -> None:
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{op or getattr(cls, 'OP', '') or cls.__name__}: expected a JSON object, got "
                                  f"{type(raw).__name__}")


class Message:
    """The base of every request and reply: a frozen dataclass whose fields are declared with this
    module's field functions. ``OP`` is set on requests by :func:`op`."""

    __slots__ = ()
    OP: ClassVar[str] = ""

    # Both are replaced on each class by its generated codec on first use (see _codec).
    def to_wire(self) -> dict[str, Any]:
        """The JSON object of this message (without ``op``)."""
        return _codec(type(self)).to_wire(self)

    @classmethod
    def from_wire(cls: type[M], raw: dict[str, Any], op: str | None = None) -> M:
        """Parse and check ``raw`` once; a bad field raises :class:`InvalidRequestError` naming it (the
        error names ``op``, else the class's op, whatever the peer put in ``"op"``)."""
        return _codec(cls).from_wire(cls, raw, op)


@dataclass(frozen=True, slots=True)
class Op:
    """One op of the registry: its name, request and reply classes, and whether a client may send it
    twice when a connection breaks before the reply (``repeatable``)."""

    name: str
    request: type[Message]
    reply: type[Message]
    repeatable: bool = False
    streams: bool = False          # a body follows the request or the reply
    served_by: str = "driver"      # the agent that serves it: "driver", "executor" or "both"

    @property
    def doc(self) -> str:
        text = (self.request.__doc__ or "").strip()
        if text.startswith(self.request.__name__ + "("):   # the dataclass's own signature: no docstring
            return ""
        return " ".join(text.split("\n\n")[0].split())


#: Every op, by name: filled when the module that declares its messages is imported.
OPS: dict[str, Op] = {}


def op(name: str, *, reply: type[Message], repeatable: bool = False, streams: bool = False,
       served_by: str = "driver") -> Callable[[type[M]], type[M]]:
    """Register the decorated request class as op ``name`` with its ``reply`` class; ``served_by``: the
    agent that serves it (``"driver"``, ``"executor"``, or ``"both"`` for an op each agent serves alike).
    An op name is unique across both agents."""
    if served_by not in ("driver", "executor", "both"):
        raise ValueError(f"served_by must be 'driver', 'executor' or 'both', not {served_by!r}")
    def register(cls: type[M]) -> type[M]:
        if name in OPS and OPS[name].request is not cls:
            raise RuntimeError(f"op {name} is declared twice ({OPS[name].request.__name__}, {cls.__name__})")
        cls.OP = name
        OPS[name] = Op(name, cls, reply, repeatable, streams, served_by)
        return cls
    return register


def read_reply(request: Message, raw: dict[str, Any]) -> Any:
    """``raw``, the reply to ``request``, parsed and checked as its op's reply class."""
    name = type(request).OP
    return OPS[name].reply.from_wire(raw, f"{name} reply")


def ask(conn: Any, request: Message, timeout: float | None = None) -> Any:
    """Send ``request`` on one connection and parse the reply as its op's reply class."""
    return read_reply(request, conn.call(request.OP, request.to_wire(), timeout))
