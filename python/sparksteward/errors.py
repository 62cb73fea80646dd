"""Errors raised by spark-steward.

Every error carries a stable ``code`` (used when an error crosses a process boundary) and a message
that says what was wrong and how to fix it. Where a builtin exception fits, the error inherits from it
too, so ``except ValueError`` or ``except FileNotFoundError`` keeps working.

Tree::

    StewardError
    ├── ConfigError (ValueError)                  CONFIG_INVALID
    ├── InvalidIdError (ValueError)               INVALID_ID
    ├── InvalidRecordError (ValueError)           INVALID_RECORD
    ├── InvalidRequestError (ValueError)          INVALID_REQUEST
    ├── ProtocolError (ValueError)                PROTOCOL
    │   ├── AuthenticationError (PermissionError) AUTH_FAILED
    │   └── MessageTooLargeError                  TOO_LARGE
    ├── AgentUnavailableError (ConnectionError)   AGENT_UNAVAILABLE
    ├── ConnectNotSupportedError                  CONNECT_NOT_SUPPORTED
    ├── RemoteError                               REMOTE (carries the remote code)
    ├── ShimBuildError (RuntimeError)             SHIM_BUILD
    ├── StorageError (OSError)                    STORAGE
    │   ├── CorruptRecordError (ValueError)       CORRUPT_RECORD
    │   └── ChecksumMismatchError                 CHECKSUM
    ├── BlobNotFoundError (FileNotFoundError)     BLOB_NOT_FOUND
    ├── BlobScopeError (PermissionError)          BLOB_SCOPE
    ├── JobStoreError                             JOB_STORE
    │   ├── JobResultExistsError (FileExistsError)   JOB_RESULT_EXISTS
    │   ├── JobAlreadyCompleted                      JOB_ALREADY_COMPLETED
    │   ├── JobResultNotFoundError (KeyError)        JOB_RESULT_NOT_FOUND
    │   └── RunConflictError                         JOB_RUN_CONFLICT
    ├── StateError                                STATE
    │   ├── StateEncodingError (ValueError)       STATE_ENCODING
    │   ├── StateSchemaError (ValueError)         STATE_SCHEMA
    │   ├── ParallelismError (ValueError)         PARALLELISM
    │   ├── StateBackendError                     STATE_BACKEND
    │   └── StateFunctionError                    STATE_FUNCTION
    └── CheckpointError                           CHECKPOINT
        ├── CheckpointNotFoundError (FileNotFoundError)  CHECKPOINT_NOT_FOUND
        ├── CheckpointCorruptError (ValueError)          CHECKPOINT_CORRUPT
        ├── CheckpointOrderError (ValueError)            CHECKPOINT_ORDER
        ├── StateLeaseError                              STATE_LEASE
        └── StateNotRegisteredError                      STATE_NOT_REGISTERED
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "AgentUnavailableError",
    "AuthenticationError",
    "BlobNotFoundError",
    "BlobScopeError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointOrderError",
    "ChecksumMismatchError",
    "ConfigError",
    "ConnectNotSupportedError",
    "CorruptRecordError",
    "InvalidIdError",
    "InvalidRecordError",
    "InvalidRequestError",
    "JobAlreadyCompleted",
    "JobResultExistsError",
    "JobResultNotFoundError",
    "JobStoreError",
    "MessageTooLargeError",
    "ParallelismError",
    "ProtocolError",
    "RemoteError",
    "RunConflictError",
    "ShimBuildError",
    "StateBackendError",
    "StateEncodingError",
    "StateError",
    "StateFunctionError",
    "StateLeaseError",
    "StateNotRegisteredError",
    "StateSchemaError",
    "StewardError",
    "StorageError",
    "error_from_code",
]


class StewardError(Exception):
    """Root of every error spark-steward raises on purpose."""

    code = "STEWARD"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def to_wire(self) -> dict[str, Any]:
        """The form this error takes when it crosses a socket: a stable code and the message."""
        return {"code": self.code, "message": self.message}


class ConfigError(StewardError, ValueError):
    """A ``spark.steward.*`` setting has a value that is not allowed."""

    code = "CONFIG_INVALID"


class InvalidIdError(StewardError, ValueError):
    """A job id, cluster id or blob key is malformed or could escape its directory."""

    code = "INVALID_ID"


class InvalidRecordError(StewardError, ValueError):
    """A record (a job result, a cleanup step) was given a field value it cannot hold."""

    code = "INVALID_RECORD"


class InvalidRequestError(StewardError, ValueError):
    """A request field is missing or has the wrong type; the message names the op, field and value.

    The connection stays usable (unless the request announced a body that was not read)."""

    code = "INVALID_REQUEST"


class ProtocolError(StewardError, ValueError):
    """A peer sent a message that does not follow the protocol."""

    code = "PROTOCOL"


class AuthenticationError(ProtocolError, PermissionError):
    """A peer did not prove that it knows the application secret."""

    code = "AUTH_FAILED"


class MessageTooLargeError(ProtocolError):
    """A peer announced or sent more bytes than the configured bound."""

    code = "TOO_LARGE"


class AgentUnavailableError(StewardError, ConnectionError):
    """An agent cannot be reached: not started, already stopped, or the plugin is not enabled."""

    code = "AGENT_UNAVAILABLE"


class ConnectNotSupportedError(StewardError):
    """A call that needs the driver's JVM was made on a Spark Connect session; the message says what to
    do instead (decision 0030)."""

    code = "CONNECT_NOT_SUPPORTED"


class RemoteError(StewardError):
    """An agent answered a request with an error; ``remote_code`` is the agent's stable code."""

    code = "REMOTE"

    def __init__(self, remote_code: str, message: str) -> None:
        super().__init__(message)
        self.remote_code = remote_code


class ShimBuildError(StewardError, RuntimeError):
    """The JVM shim jar could not be built or located."""

    code = "SHIM_BUILD"


class StorageError(StewardError, OSError):
    """A storage operation failed; the message names the path."""

    code = "STORAGE"


class CorruptRecordError(StorageError, ValueError):
    """A stored record is partial, unparsable or of an unknown version; the message names the file."""

    code = "CORRUPT_RECORD"


class ChecksumMismatchError(StorageError):
    """Stored or transferred bytes do not hash to their content key."""

    code = "CHECKSUM"


class BlobNotFoundError(StewardError, FileNotFoundError):
    """No good copy of a blob exists in any source."""

    code = "BLOB_NOT_FOUND"


class BlobScopeError(StewardError, PermissionError):
    """A ``steward://`` URL names another application's or another cluster's blob scope."""

    code = "BLOB_SCOPE"


class JobStoreError(StewardError):
    """A JobResultStore operation failed."""

    code = "JOB_STORE"


class JobResultExistsError(JobStoreError, FileExistsError):
    """A result for this job id already exists, dirty or clean."""

    code = "JOB_RESULT_EXISTS"


class JobAlreadyCompleted(JobStoreError):
    """The job already has a stored result, so it is not run again.

    ``entry`` is the stored ``JobResultEntry``.
    """

    code = "JOB_ALREADY_COMPLETED"

    def __init__(self, message: str, entry: Any = None) -> None:
        super().__init__(message)
        self.entry = entry


class JobResultNotFoundError(JobStoreError, KeyError):
    """No result is stored for this job id."""

    code = "JOB_RESULT_NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class RunConflictError(JobStoreError):
    """The stored entry belongs to another run of the job (a forced re-run replaced it, or a run of
    the job is live in another process); the write was refused."""

    code = "JOB_RUN_CONFLICT"


# --- keyed state and checkpoints (issue 8) ------------------------------------------------------
class StateError(StewardError):
    """A keyed-state operation failed."""

    code = "STATE"


class StateEncodingError(StateError, ValueError):
    """A key or value cannot be encoded (or stored bytes cannot be decoded); the message names it."""

    code = "STATE_ENCODING"


class StateSchemaError(StateError, ValueError):
    """A declared state variable cannot be opened as declared (a type change that is not an evolution,
    a bad declaration); the message names the variable, the old and new declaration and the fix."""

    code = "STATE_SCHEMA"


class ParallelismError(StateError, ValueError):
    """A parallelism or max parallelism is out of range, or the max parallelism changed on restore."""

    code = "PARALLELISM"


class StateBackendError(StateError):
    """The local RocksDB of a subtask cannot be opened, written or snapshotted; the message names the dir."""

    code = "STATE_BACKEND"


class StateFunctionError(StateError):
    """The user's state function raised (its exception is the ``__cause__``) or returned what cannot be
    its output. The first line names the state, the checkpoint, the subtask and, in the per-key form,
    the key; the function's own traceback follows."""

    code = "STATE_FUNCTION"


class CheckpointError(StewardError):
    """A checkpoint could not be written, read, restored or coordinated."""

    code = "CHECKPOINT"


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, its ``_metadata`` or one of its files does not exist."""

    code = "CHECKPOINT_NOT_FOUND"


class CheckpointCorruptError(CheckpointError, ValueError):
    """A checkpoint record or file is unreadable, of a newer version, or does not match its checksum."""

    code = "CHECKPOINT_CORRUPT"


class CheckpointOrderError(CheckpointError, ValueError):
    """A checkpoint id is used out of order (older than the last completed one, or not begun)."""

    code = "CHECKPOINT_ORDER"


class StateLeaseError(CheckpointError):
    """Another live application holds the writer lease of a state (one state has one writer), or this
    one lost it."""

    code = "STATE_LEASE"


class StateNotRegisteredError(CheckpointError):
    """The driver agent does not know the keyed state (it restarted since the state was opened)."""

    code = "STATE_NOT_REGISTERED"


_BY_CODE: dict[str, type[StewardError]] = {}


def _register(cls: type[StewardError]) -> None:
    _BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(StewardError)


def error_from_code(code: str, message: str) -> StewardError:
    """Rebuild an error that crossed a socket as ``{"code", "message"}``."""
    cls = _BY_CODE.get(code)
    if cls is None or cls in (RemoteError, JobAlreadyCompleted):
        return RemoteError(code, message)
    return cls(message)
