"""The generated codecs (wire/messages.py ``_codec``) against the field specs they are built from.

A codec inlines each field's common case and sends everything else to the field's ``parse``. This
test checks, over every registered message class and a seeded stream of values good and bad, that
a generated ``from_wire`` accepts exactly what the specs' own parse accepts, with the same value or
the same error, and that ``to_wire`` writes what the specs' dump writes. The seed is printed; rerun
one with ``STEWARD_CODEC_SEED``.
"""

from __future__ import annotations

import dataclasses
import os
import random
from typing import Any

import sparksteward.blob.messages
import sparksteward.checkpoint.lifecycle_messages
import sparksteward.checkpoint.messages
import sparksteward.jobs.messages  # noqa: F401  (fill the registry)
from sparksteward.errors import StewardError
from sparksteward.wire.fields import Fields
from sparksteward.wire.messages import OPS, Message, _codec, integer, mapping, sequence

_MISSING = object()
_POOL: list[Any] = [
    _MISSING, None, True, False, 0, 1, -1, 7, 32768, 32769, 1 << 62, (1 << 62) + 1, 1.5, -0.0, float("inf"),
    "", "x", "a" * 300, "t-" + "ab" * 16, "p-" + "0f" * 16, "t-AB", "job-1", "daily/2026-11-22", "../up", "a//b",
    "p", "t", "json", "arrow", [], [1, 2], ["a", "b"], [{"x": 1}], list(range(2000)), {}, {"a": 1},
]


def _classes() -> list[Any]:
    """Every message class: the registry's and the ones nested inside them."""
    found, todo = [], list(Message.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [c for c in found if dataclasses.is_dataclass(c)]


def _reference(cls: Any, raw: dict[str, Any], op: str) -> Any:
    """What the field specs say, one ``parse`` per field (no generated code)."""
    f = Fields(raw)
    f.op = op
    kwargs = {}
    for fld in dataclasses.fields(cls):
        spec = fld.metadata.get("wire")
        if spec is not None:
            kwargs[fld.name] = spec.parse(f, fld.name)
    return cls(**kwargs)


def _outcome(fn: Any, *args: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except (StewardError, ValueError, TypeError) as exc:
        return "error", f"{type(exc).__name__}: {exc}"


def test_generated_codecs_accept_and_refuse_what_the_field_specs_do():
    seed = int(os.environ.get("STEWARD_CODEC_SEED", random.randrange(1 << 30)))
    print(f"codec seed {seed} (rerun with STEWARD_CODEC_SEED={seed})")
    rng = random.Random(seed)
    classes = _classes()
    assert len(classes) > 60 and {c for op in OPS.values() for c in (op.request, op.reply)} <= set(classes)
    accepted = checked_dumps = 0
    for cls in classes:
        names = [fld.name for fld in dataclasses.fields(cls) if "wire" in fld.metadata]
        for _ in range(60):
            raw = {n: v for n in names if (v := rng.choice(_POOL)) is not _MISSING}
            got = _outcome(cls.from_wire, raw, "test.op")
            want = _outcome(_reference, cls, raw, "test.op")
            assert got == want, f"seed {seed}: {cls.__name__} from {raw!r}"
            if got[0] == "ok":
                accepted += 1
                message = got[1]
                reference_dump = {}
                for fld in dataclasses.fields(cls):
                    spec = fld.metadata.get("wire")
                    value = getattr(message, fld.name)
                    if spec is None or (value is None and spec.omit_none):
                        continue
                    reference_dump[fld.name] = spec.dump(value) if spec.dump and value is not None else value
                if type(message).__dict__.get("to_wire") is _codec(type(message)).to_wire:   # not its own
                    checked_dumps += 1
                    assert message.to_wire() == reference_dump, f"seed {seed}: {cls.__name__}"
                assert cls.from_wire(message.to_wire(), "test.op") == message, f"seed {seed}: {cls.__name__}"
    assert accepted > 200 and checked_dumps > 150   # the stream reaches the accepting paths, not only the refusals


@dataclasses.dataclass(frozen=True, slots=True)
class _Defaults(Message):
    items: list[str] = sequence(default=[])
    extra: dict[str, Any] = mapping(default={})


def test_a_mutable_default_is_a_new_object_per_message():
    # a missing list or object field gives each message its own, never one shared by every message
    a, b = _Defaults.from_wire({}), _Defaults.from_wire({"items": None})
    assert a == b == _Defaults()
    assert a.items is not b.items and a.extra is not b.extra
    a.items.append("x")
    assert _Defaults.from_wire({}).items == []


@dataclasses.dataclass(frozen=True, slots=True)
class _Base(Message):
    a: int = integer(default=0)


@dataclasses.dataclass(frozen=True, slots=True)
class _Sub(_Base):
    b: int = integer(default=0)


def test_a_subclass_uses_its_own_codec_whichever_class_is_used_first():
    # the codec is installed on the class it was made for; a subclass inheriting it hands over to its own
    assert _Base(1).to_wire() == {"a": 1} and _Base.from_wire({"a": 1, "b": 2}) == _Base(1)
    assert _Sub(1, 2).to_wire() == {"a": 1, "b": 2}
    got = _Sub.from_wire({"a": 1, "b": 2})
    assert type(got) is _Sub and got == _Sub(1, 2)
