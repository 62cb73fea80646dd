"""FLIP-306 space control, on the driver side: how much of the merged files' space is live, and which
physical files the next checkpoint should stop reusing.

The coordinator owns the reference counts (placement changes every batch in Spark, so no executor can
own a file; see docs/decisions/0010). From the retained records, :func:`space_stats` computes
physical and live logical bytes (FLIP-306's ``SpaceStat``), and when physical bytes exceed live bytes
times ``max_space_amplification``, :func:`choose_no_reuse` marks the most wasteful physical files
no-reuse: the next checkpoint writes their live segments again (the compaction), and the old files go
once no retained checkpoint references them. :func:`is_merged` tells a merged physical file's path
from any other. Pure functions of the records.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.checkpoint.storage import MERGED_DIR

__all__ = ["SpaceStats", "choose_no_reuse", "is_merged", "physical_sizes", "space_stats"]

_MERGED_NAME = re.compile(r"^[0-9a-f]{32}$")


def is_merged(path: str) -> bool:
    """True for a physical file of this state's ``merged/`` directory: ``merged/<32 hex>`` exactly, so
    a path a peer sends (``merged/../x``) is never taken for one."""
    head, _, name = path.partition("/")
    return head == MERGED_DIR and bool(_MERGED_NAME.match(name))


@dataclass(frozen=True, slots=True)
class SpaceStats:
    """Physical against live logical bytes of a state's merged files (FLIP-306's ``SpaceStat``)."""

    physical_files: int
    physical_bytes: int
    logical_files: int
    logical_bytes: int
    whole_files: int        # files outside merged/ (large SSTs kept whole)
    whole_bytes: int

    @property
    def amplification(self) -> float:
        return self.physical_bytes / self.logical_bytes if self.logical_bytes else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"physical_files": self.physical_files, "physical_bytes": self.physical_bytes,
                "logical_files": self.logical_files, "logical_bytes": self.logical_bytes,
                "whole_files": self.whole_files, "whole_bytes": self.whole_bytes,
                "amplification": round(self.amplification, 3)}


def physical_sizes(metas: Iterable[CheckpointMetadata]) -> dict[str, int]:
    """The size of every merged physical file the records name (``properties.merged``)."""
    out: dict[str, int] = {}
    for m in metas:
        listed = m.properties.get("merged")
        if isinstance(listed, dict):
            for path, size in listed.items():
                if isinstance(path, str) and isinstance(size, int) and not isinstance(size, bool):
                    out[path] = max(out.get(path, 0), size)
    return out


def _segments(metas: Iterable[CheckpointMetadata]) -> dict[str, dict[tuple[int, int], int]]:
    live: dict[str, dict[tuple[int, int], int]] = {}
    for m in metas:
        for f in m.files():
            if is_merged(f.path):
                live.setdefault(f.path, {})[(f.offset, f.length)] = f.length
    return live


def space_stats(metas: Iterable[CheckpointMetadata]) -> SpaceStats:
    """Physical and live bytes over the retained records ``metas``."""
    metas = list(metas)
    sizes = physical_sizes(metas)
    live = _segments(metas)
    whole = {f.path: f.length for m in metas for f in m.files() if not is_merged(f.path)}
    return SpaceStats(physical_files=len(live), physical_bytes=sum(sizes.get(p, sum(s.values()))
                                                                  for p, s in live.items()),
                      logical_files=sum(len(s) for s in live.values()),
                      logical_bytes=sum(sum(s.values()) for s in live.values()),
                      whole_files=len(whole), whole_bytes=sum(whole.values()))


def choose_no_reuse(metas: Iterable[CheckpointMetadata], amplification: float) -> set[str]:
    """The physical files whose live segments the next checkpoint writes again (space control).

    When physical bytes exceed live bytes times ``amplification``, take files in order of most
    wasted bytes until the bytes left would be within the bound. ``amplification`` below 1 turns it
    off (Flink's semantics).
    """
    if amplification < 1:
        return set()
    metas = list(metas)
    sizes = physical_sizes(metas)
    live = _segments(metas)
    physical = sum(sizes.get(p, sum(s.values())) for p, s in live.items())
    logical = sum(sum(s.values()) for s in live.values())
    if physical <= logical * amplification:
        return set()
    waste = sorted(((sizes.get(p, 0) - sum(s.values()), p) for p, s in live.items()), reverse=True)
    chosen: set[str] = set()
    for wasted, path in waste:
        if physical <= logical * amplification or wasted <= 0:
            break
        chosen.add(path)
        physical -= wasted   # its live bytes move to a new file; the waste goes with the old one
    return chosen
