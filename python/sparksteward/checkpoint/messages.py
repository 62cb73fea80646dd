"""Typed replies of the checkpoint ops that carry more than a value or two, read and written on both
sides of the socket (the driver agent's :class:`~sparksteward.checkpoint.coordination.gateway.CheckpointGateway`,
the executor agent's :class:`~sparksteward.checkpoint.task.task_state.SubtaskService`). The ack's stats are
:class:`~sparksteward.checkpoint.coordination.stats.SubtaskStats`.

**The base of an attempt is sent once per executor agent.** Every task of a checkpoint asks
``state.base`` (the ask records which agent works on which subtask and returns its cut), but the base
record and its known files are the same for every subtask of one attempt, and can be large. An agent
names the attempt whose base it holds (``have``); when that is still the current attempt, the reply
leaves them out (``same_base``) and the agent reuses its copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.errors import InvalidRecordError
from sparksteward.wire import Fields

__all__ = ["BaseReply"]


@dataclass(frozen=True, slots=True)
class BaseReply:
    """What a subtask of checkpoint ``checkpoint_id`` restores and how it runs (``state.base``)."""

    checkpoint_id: int
    attempt: str
    rerun: bool
    checkpoint_dir: str
    cluster_id: str
    parallelism: int
    max_parallelism: int
    key_type: str
    base: CheckpointMetadata | None                 # None: start from an empty state
    known: dict[str, tuple[str, int]]               # checksum -> (path, offset) the upload may reuse
    merging: dict[str, Any]
    alignment: dict[str, Any]
    deadline_in: float | None = None                # unaligned: seconds until the subtask defers input
    cut: int | None = None                          # FLIP-76: the cut an earlier attempt recorded

    def to_json(self, *, with_base: bool = True) -> dict[str, Any]:
        out = {"checkpoint_id": self.checkpoint_id, "attempt": self.attempt, "rerun": self.rerun,
               "checkpoint_dir": self.checkpoint_dir, "cluster_id": self.cluster_id,
               "parallelism": self.parallelism, "max_parallelism": self.max_parallelism, "key_type": self.key_type,
               "merging": self.merging, "alignment": self.alignment, "deadline_in": self.deadline_in, "cut": self.cut}
        if with_base:
            out["base"] = None if self.base is None else self.base.to_json()
            out["known"] = {k: list(v) for k, v in self.known.items()}
        else:
            out["same_base"] = True
        return out

    @classmethod
    def from_reply(cls, reply: dict[str, Any], held: BaseReply | None = None) -> BaseReply:
        """Read a ``state.base`` reply; ``held``: the reply of the attempt the request named in
        ``have``, whose base a ``same_base`` reply reuses."""
        f = Fields({**reply, "op": "state.base reply"})
        cid = f.integer("checkpoint_id", lo=0)
        attempt = f.text("attempt", default="", max_len=64)
        deadline = reply.get("deadline_in")
        base: CheckpointMetadata | None
        if reply.get("same_base"):
            if held is None or (held.checkpoint_id, held.attempt) != (cid, attempt):
                raise InvalidRecordError(f"the driver agent left out the base of checkpoint {cid} (attempt "
                                         f"{attempt}), which this executor agent does not hold")
            base, known = held.base, held.known
        else:
            raw = reply.get("base")
            base = None if raw is None else CheckpointMetadata.from_bytes(orjson.dumps(raw),
                                                                          f"the base of checkpoint {cid}")
            known = _known(f.mapping("known", default=None) or {}, cid)
        return cls(
            checkpoint_id=cid, attempt=attempt, rerun=f.flag("rerun", default=False),
            checkpoint_dir=f.text("checkpoint_dir", max_len=4096), cluster_id=f.text("cluster_id", max_len=200),
            parallelism=f.integer("parallelism", lo=1), max_parallelism=f.integer("max_parallelism", lo=1),
            key_type=f.text("key_type", max_len=16), base=base, known=known,
            merging=f.mapping("merging", default=None) or {}, alignment=f.mapping("alignment", default=None) or {},
            deadline_in=None if deadline is None else f.number("deadline_in", lo=0),
            cut=f.integer("cut", default=None, lo=0))


def _known(raw: dict[str, Any], cid: int) -> dict[str, tuple[str, int]]:
    """The ``known`` field: checksum -> [path, offset]; anything else is refused by name."""
    out = {}
    for k, v in raw.items():
        if (not isinstance(v, list) or len(v) != 2 or not isinstance(v[0], str) or isinstance(v[1], bool)
                or not isinstance(v[1], int) or v[1] < 0):
            raise InvalidRecordError(f"the base of checkpoint {cid} lists known file {str(k)[:80]!r} as "
                                     f"{str(v)[:80]}, not [path, offset]")
        out[str(k)] = (v[0], v[1])
    return out
