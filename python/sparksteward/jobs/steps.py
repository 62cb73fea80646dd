"""Cleanup steps: declarative ``{kind, target}`` records, and the registry that runs them.

A :class:`CleanupStep` is ``{kind, target}``. Its state is stored in the dirty result, so a driver
started later can run it again. A :class:`StepRegistry` maps each kind to an executor, a function
``fn(target) -> None`` that must be idempotent: deleting something that is already gone is success.
The built-in kinds are:

``delete_path``
    Any fsspec URL or absolute local path, file or directory, deleted recursively
    (``job.cleanup_path``); :mod:`sparksteward.jobs.pathguard` says which paths it refuses.
``spark_checkpoint_dir``
    The application's ``sc.setCheckpointDir`` directory, which Spark never deletes. It runs the
    same operation as ``delete_path``; the kind exists so that listings say what the path was.
``blob_job_dir``
    The job's blob directory in local and HA storage; the target is the job id. The driver agent
    registers its BlobServer's ``delete_job``. Without one (a later driver, ``steward jobs cleanup``)
    :class:`BlobJobDirCleanup` deletes ``<ha-path>/<cluster-id>/blob/<encoded job>/``.

More kinds can be registered with :meth:`StepRegistry.register`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from sparksteward.errors import InvalidRecordError
from sparksteward.ids import job_id_to_filename, validate_id, validate_job_id
from sparksteward.jobs.pathguard import delete_path, normalize_path_target
from sparksteward.jobs.result import StepState
from sparksteward.storage import open_location

__all__ = ["BlobJobDirCleanup", "CleanupStep", "StepExecutor", "StepRegistry"]

log = logging.getLogger("sparksteward.jobs.steps")

StepExecutor = Callable[[str], None]
"""Runs one step on its target; idempotent; raises on failure (the runner retries)."""

_KIND = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
MAX_TARGET = 4096


@dataclass(frozen=True, slots=True)
class CleanupStep:
    """One declarative cleanup step: what to do (``kind``) to what (``target``).

    Its JSON form is ``{"kind": ..., "target": ...}``.
    """

    kind: str
    target: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not _KIND.match(self.kind):
            raise InvalidRecordError(f"cleanup step kind {self.kind!r} is not valid: use lower-case letters, "
                                     f"digits and '_', such as 'delete_path'")
        if (not isinstance(self.target, str) or not self.target.strip() or len(self.target) > MAX_TARGET
                or any(ord(c) < 0x20 for c in self.target)):
            raise InvalidRecordError(f"cleanup step {self.kind}: target {self.target!r} must be 1 to {MAX_TARGET} "
                                     f"printable characters")

    def __str__(self) -> str:
        return f"{self.kind} {self.target}"

    def state(self) -> StepState:
        """A fresh, pending :class:`StepState` for this step."""
        return StepState(self.kind, self.target)

    @classmethod
    def of(cls, state: StepState) -> CleanupStep:
        return cls(state.kind, state.target)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "target": self.target}

    @classmethod
    def from_dict(cls, d: Any, source: str = "cleanup step") -> CleanupStep:
        if not isinstance(d, dict) or "kind" not in d or "target" not in d:
            raise InvalidRecordError(f"{source}: expected {{\"kind\": ..., \"target\": ...}}, got {d!r}")
        return cls(d["kind"], d["target"])

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes | str, source: str = "cleanup step") -> CleanupStep:
        try:
            doc = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InvalidRecordError(f"{source} is not valid JSON: {exc}") from exc
        return cls.from_dict(doc, source)



class BlobJobDirCleanup:
    """The default ``blob_job_dir`` executor: delete ``<ha_root>/<cluster_id>/blob/<encoded job>/``.

    For a process without a BlobServer (a later driver finishing a dirty entry, the CLI). With no HA
    root there is no HA copy, and the step is a no-op. A driver's local blob directories belong to its
    own agent process and are swept by the next one.
    """

    def __init__(self, ha_root: str | None, cluster_id: str = "default") -> None:
        self.ha_root = ha_root
        self.cluster_id = validate_id(cluster_id, "cluster id")

    def __call__(self, job_id: str) -> None:
        if not self.ha_root:
            log.debug("job %s: no HA blob storage configured; nothing to delete", job_id)
            return
        loc = open_location(self.ha_root).child(self.cluster_id, "blob", job_id_to_filename(job_id))
        if loc.delete(loc.root, recursive=True):
            log.info("deleted the HA blob directory %s", loc.url)

    def __repr__(self) -> str:
        return f"BlobJobDirCleanup({self.ha_root!r}, {self.cluster_id!r})"


class StepRegistry:
    """Maps step kinds to executors. Thread-safe.

    Parameters
    ----------
    ha_root
        HA storage root for the default ``blob_job_dir`` executor (:class:`BlobJobDirCleanup`).
    cluster_id
        The cluster id whose blob directories that executor deletes.
    blob_job_dir
        An executor ``(job_id) -> None`` to use for ``blob_job_dir`` instead (the driver agent's
        BlobServer.delete_job).
    """

    def __init__(self, ha_root: str | None = None, cluster_id: str = "default",
                 blob_job_dir: StepExecutor | None = None) -> None:
        self._lock = threading.Lock()
        self._executors: dict[str, StepExecutor] = {}
        self._validators: dict[str, Callable[[str], Any]] = {}
        self.register("delete_path", delete_path, validate=normalize_path_target)
        self.register("spark_checkpoint_dir", delete_path, validate=normalize_path_target)
        self.register("blob_job_dir", blob_job_dir or BlobJobDirCleanup(ha_root, cluster_id), validate=validate_job_id)

    def register(self, kind: str, executor: StepExecutor, *, validate: Callable[[str], Any] | None = None) -> None:
        """Run ``executor(target)`` for steps of ``kind`` (replacing any earlier one).

        ``validate(target)``, if given, is called when a step is added and raises
        InvalidRecordError for targets that can never work. If it returns a string, that is the
        target's normal form, which :meth:`prepare` records instead.
        """
        CleanupStep(kind, "x")  # validates the kind
        if not callable(executor):
            raise InvalidRecordError(f"cleanup step kind {kind!r}: the executor {executor!r} is not callable")
        with self._lock:
            self._executors[kind] = executor
            if validate is None:
                self._validators.pop(kind, None)
            else:
                self._validators[kind] = validate

    def kinds(self) -> list[str]:
        with self._lock:
            return sorted(self._executors)

    def _get(self, kind: str) -> StepExecutor:
        with self._lock:
            executor = self._executors.get(kind)
        if executor is None:
            raise InvalidRecordError(f"unknown cleanup step kind {kind!r} (known here: {', '.join(self.kinds())}). "
                                     f"Register it in this process, or run the cleanup where it is registered")
        return executor

    def validate(self, step: CleanupStep) -> None:
        """Raise InvalidRecordError if ``step`` can never run here (unknown kind, bad target)."""
        self._get(step.kind)
        with self._lock:
            validator = self._validators.get(step.kind)
        if validator is not None:
            validator(step.target)

    def prepare(self, step: CleanupStep) -> CleanupStep:
        """Validate ``step`` (:meth:`validate`) and return it with its target in normal form."""
        self._get(step.kind)
        with self._lock:
            validator = self._validators.get(step.kind)
        normal = validator(step.target) if validator is not None else None
        return CleanupStep(step.kind, normal) if isinstance(normal, str) and normal != step.target else step

    def run(self, step: CleanupStep | str, target: str | None = None) -> None:
        """Run one step: ``run(step)`` or ``run(kind, target)``. Raises whatever the executor raises."""
        if not isinstance(step, CleanupStep):
            step = CleanupStep(step, target or "")
        self.validate(step)
        self._get(step.kind)(step.target)
