"""Checkpoint records: file handles, subtask handles and the versioned ``_metadata`` record.

A checkpoint of one state is ``chk-<N>/_metadata``: a versioned JSON document. Layout (version 1)::

    {
      "version": 1,
      "state": "clicks",
      "checkpoint_id": 42,
      "parallelism": 8,
      "max_parallelism": 128,
      "key_type": "string",
      "created_at": 1763812345.123,          # seconds since the epoch
      "subtasks": [
        {"subtask": 0, "key_groups": [0, 16],
         "files": [{"name": "000012.sst", "path": "shared/<32 hex>",
                    "offset": 0, "length": 1234, "checksum": "<32 hex>"}, ...],
         "channel_state": []},             # FLIP-76: in-flight data handles, same file-handle form
        ...
      ],
      "properties": {}                      # free-form (restored-from, savepoint, ...)
    }

A :class:`FileHandle` is a *logical* file: the local ``name`` it takes in the DB directory, and the
bytes ``[offset, offset + length)`` of the *physical* file at ``path``. A file under ``shared/`` is
a whole physical file (``offset == 0``); FLIP-306 file merging packs many small ones into one
``merged/<uuid>`` physical file, whose size the record lists in ``properties.merged``. ``path`` is relative to the state's checkpoint root (``shared/...``,
``merged/...``) or an absolute URL (a CLAIMed file of another state). ``checksum`` is the xxh3-128 of
the logical bytes, and shared files are named by it, because SST names repeat across lineages.

``from_json`` rejects a newer version, unknown shapes and bad values with
:class:`~sparksteward.errors.CheckpointCorruptError` naming the file.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from sparksteward.errors import CheckpointCorruptError, InvalidRecordError, ParallelismError
from sparksteward.state.keygroups import KeyGroupRange, KeyType, validate_parallelism

__all__ = ["CheckpointMetadata", "FileHandle", "METADATA_VERSION", "SubtaskHandle", "check_max_parallelism"]

METADATA_VERSION = 1
_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,255}$")


@dataclass(frozen=True, slots=True)
class FileHandle:
    """One logical file: ``length`` bytes at ``offset`` of the physical file ``path``."""

    name: str
    path: str
    length: int
    checksum: str
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name) or self.name in (".", ".."):
            raise InvalidRecordError(f"file name {self.name!r} is not a plain file name")
        if not isinstance(self.path, str) or not self.path or (
                "://" not in self.path and (self.path.startswith("/") or ".." in self.path.split("/"))):
            raise InvalidRecordError(f"file path {self.path!r} must be relative to the checkpoint root, or a URL")
        for label, v in (("length", self.length), ("offset", self.offset)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidRecordError(f"file {self.name}: {label} {v!r} must be an int >= 0")
        if not isinstance(self.checksum, str) or not _HEX32.match(self.checksum):
            raise InvalidRecordError(f"file {self.name}: checksum {self.checksum!r} is not 32 lowercase hex digits")

    @property
    def is_segment(self) -> bool:
        """True when the logical file lives in a merged physical file (FLIP-306): ``merged/<uuid>``,
        here or (claimed) in another state's directory."""
        return self.offset != 0 or ("/" + self.path).rsplit("/", 2)[-2] == "merged"

    @property
    def is_relative(self) -> bool:
        return "://" not in self.path

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "path": self.path, "offset": self.offset, "length": self.length,
                "checksum": self.checksum}

    @classmethod
    def from_json(cls, d: Any) -> FileHandle:
        if not isinstance(d, dict):
            raise InvalidRecordError(f"file handle {d!r} is not an object")
        fields: Any = d  # unchecked JSON values: __post_init__ validates them
        return cls(name=fields.get("name"), path=fields.get("path"), length=fields.get("length"),
                   checksum=fields.get("checksum"), offset=fields.get("offset", 0))


@dataclass(frozen=True, slots=True)
class SubtaskHandle:
    """The state of one subtask in one checkpoint: its key groups and its files."""

    subtask: int
    key_groups: KeyGroupRange
    files: tuple[FileHandle, ...]
    channel_state: tuple[FileHandle, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.subtask, bool) or not isinstance(self.subtask, int) or self.subtask < 0:
            raise InvalidRecordError(f"subtask index {self.subtask!r} must be an int >= 0")
        object.__setattr__(self, "files", tuple(self.files))
        object.__setattr__(self, "channel_state", tuple(self.channel_state))
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise InvalidRecordError(f"subtask {self.subtask} lists a file name twice: {sorted(names)}")
        if self.files and "CURRENT" not in names:
            raise InvalidRecordError(f"subtask {self.subtask} has files but no CURRENT: not a RocksDB snapshot")

    @property
    def all_files(self) -> tuple[FileHandle, ...]:
        """Every file the subtask references: its state and its channel state (both hold segments)."""
        return (*self.files, *self.channel_state)

    @property
    def size(self) -> int:
        return sum(f.length for f in self.all_files)

    def to_json(self) -> dict[str, Any]:
        return {"subtask": self.subtask, "key_groups": self.key_groups.to_json(),
                "files": [f.to_json() for f in self.files],
                "channel_state": [f.to_json() for f in self.channel_state]}

    @classmethod
    def from_json(cls, d: Any) -> SubtaskHandle:
        if not isinstance(d, dict) or not isinstance(d.get("files"), list):
            raise InvalidRecordError(f"subtask handle {str(d)[:80]!r} is not an object with a files list")
        fields: Any = d  # unchecked JSON values: __post_init__ validates them
        return cls(subtask=fields.get("subtask"), key_groups=KeyGroupRange.from_json(fields.get("key_groups")),
                   files=tuple(FileHandle.from_json(f) for f in fields["files"]),
                   channel_state=tuple(FileHandle.from_json(f) for f in fields.get("channel_state", [])))


@dataclass(frozen=True, slots=True)
class CheckpointMetadata:
    """``chk-<N>/_metadata``: every subtask's handle for checkpoint ``checkpoint_id`` of ``state``."""

    state: str
    checkpoint_id: int
    parallelism: int
    max_parallelism: int
    subtasks: tuple[SubtaskHandle, ...]
    key_type: KeyType = KeyType.STRING
    created_at: float = 0.0
    properties: dict[str, Any] = field(default_factory=dict)
    version: int = METADATA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.state, str) or not self.state:
            raise InvalidRecordError(f"state name {self.state!r} must be a non-empty str")
        if isinstance(self.checkpoint_id, bool) or not isinstance(self.checkpoint_id, int) or self.checkpoint_id < 0:
            raise InvalidRecordError(f"checkpoint id {self.checkpoint_id!r} must be an int >= 0")
        validate_parallelism(self.parallelism, self.max_parallelism)
        object.__setattr__(self, "key_type", KeyType.parse(self.key_type))
        object.__setattr__(self, "subtasks", tuple(sorted(self.subtasks, key=lambda s: s.subtask)))
        if [s.subtask for s in self.subtasks] != list(range(self.parallelism)):
            raise InvalidRecordError(
                f"checkpoint {self.checkpoint_id} of {self.state!r} needs one handle per subtask "
                f"0..{self.parallelism - 1}, got {[s.subtask for s in self.subtasks]}")
        groups = [g for s in self.subtasks for g in (s.key_groups.start, s.key_groups.stop)]
        if groups[0] != 0 or groups[-1] != self.max_parallelism or any(
                groups[i] != groups[i + 1] for i in range(1, len(groups) - 1, 2)):
            raise InvalidRecordError(
                f"checkpoint {self.checkpoint_id} of {self.state!r}: subtask key groups "
                f"{[str(s.key_groups) for s in self.subtasks]} do not tile [0, {self.max_parallelism})")

    def files(self) -> list[FileHandle]:
        """Every file handle of every subtask (state and channel state)."""
        return [f for s in self.subtasks for f in s.all_files]

    def physical_paths(self) -> set[str]:
        return {f.path for f in self.files()}

    @property
    def size(self) -> int:
        return sum(s.size for s in self.subtasks)

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "state": self.state, "checkpoint_id": self.checkpoint_id,
                "parallelism": self.parallelism, "max_parallelism": self.max_parallelism,
                "key_type": self.key_type.value, "created_at": self.created_at,
                "subtasks": [s.to_json() for s in self.subtasks], "properties": self.properties}

    def to_bytes(self) -> bytes:
        return orjson.dumps(self.to_json(), option=orjson.OPT_INDENT_2)

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> CheckpointMetadata:
        """Parse ``_metadata`` read from ``source`` (named in every error)."""
        try:
            d = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise CheckpointCorruptError(f"{source} is not valid JSON ({exc}): the checkpoint is corrupt or "
                                         f"partially written; restore an older checkpoint") from exc
        if not isinstance(d, dict) or "version" not in d:
            raise CheckpointCorruptError(f"{source} is not a spark-steward checkpoint record (no version)")
        version = d["version"]
        if isinstance(version, bool) or not isinstance(version, int):
            raise CheckpointCorruptError(f"{source} has version {version!r}, which is not an int")
        if version > METADATA_VERSION:
            raise CheckpointCorruptError(
                f"{source} was written by a newer spark-steward (metadata version {version}; this one reads "
                f"up to {METADATA_VERSION}): upgrade spark-steward to restore it")
        if version < 1:
            raise CheckpointCorruptError(f"{source} has unknown metadata version {version}")
        try:
            return cls(state=d["state"], checkpoint_id=d["checkpoint_id"], parallelism=d["parallelism"],
                       max_parallelism=d["max_parallelism"], key_type=d.get("key_type", "string"),
                       created_at=float(d.get("created_at", 0.0)),
                       subtasks=tuple(SubtaskHandle.from_json(s) for s in d["subtasks"]),
                       properties=dict(d.get("properties") or {}), version=version)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointCorruptError(f"{source} is not a valid checkpoint record: {exc}") from exc


def check_max_parallelism(meta: CheckpointMetadata, max_parallelism: int) -> None:
    """Refuse a restore of ``meta`` that changes the max parallelism, naming both values and the fix:
    the max parallelism fixes the key groups of every record of a state."""
    if max_parallelism != meta.max_parallelism:
        raise ParallelismError(
            f"Changing max_parallelism is refused: state {meta.state!r} was checkpointed with "
            f"max_parallelism={meta.max_parallelism} (checkpoint {meta.checkpoint_id}) and cannot be restored "
            f"with max_parallelism={max_parallelism}: "
            f"the max parallelism fixes the key groups and cannot change. Keep "
            f"max_parallelism={meta.max_parallelism} (any parallelism up to it works), or start a new state")


def shared_path(checksum: str) -> str:
    """Where a content-addressed file lives, relative to the state's checkpoint root."""
    return posixpath.join("shared", checksum)
