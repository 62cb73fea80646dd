"""Job cleanup: declarative steps, retried with backoff until they succeed, then the commit.

A :class:`CleanupStep` is ``{kind, target}``. Its state is stored in the dirty result, so a driver
started later can run it again. A :class:`StepRegistry` maps each kind to an executor, a function
``fn(target) -> None`` that must be idempotent: deleting something that is already gone is success.
The built-in kinds are:

``delete_path``
    Any fsspec URL or absolute local path, file or directory, deleted recursively
    (``job.cleanup_path``).
``spark_checkpoint_dir``
    The application's ``sc.setCheckpointDir`` directory, which Spark never deletes. It runs the
    same operation as ``delete_path``; the kind exists so that listings say what the path was.
``blob_job_dir``
    The job's blob directory in local and HA storage; the target is the job id. The driver agent
    registers its BlobServer's ``delete_job``. Without one (a later driver, ``steward jobs cleanup``)
    :class:`BlobJobDirCleanup` deletes ``<ha-path>/<cluster-id>/blob/<encoded job>/``.

More kinds can be registered with :meth:`StepRegistry.register`.

:class:`CleanupRunner` follows FLIP-194's order on a result that is already stored dirty. It runs every
pending step and retries each failed one on its own schedule from a :class:`RetryPolicy`. After every
change it records the step's state in the dirty result (pending, done or failed, with the attempts,
the last error and the next attempt time). Once all steps are done it commits (marks the result
clean). Step failures never raise to the caller: they are logged and kept in the entry. A step that
cannot succeed in this process (an unknown kind, an invalid target) fails at once, without retries.
One that exhausts its attempts also stops being retried. Either way the result stays dirty, for
``steward jobs cleanup`` to finish after the cause is fixed.

Runs. Every save and the commit compare the result's ``run_id`` with the stored one (the store's
compare-and-swap). When a forced re-run of the job id has replaced the entry, the older run's late
write fails with :class:`~sparksteward.errors.RunConflictError`: the runner logs it and ends with
``SUPERSEDED`` (the newer run carried the unfinished steps over), never overwriting the newer result.
"""

from __future__ import annotations

import enum
import logging
import os
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import orjson

from sparksteward.errors import (CorruptRecordError, InvalidIdError, InvalidRecordError, JobResultNotFoundError,
                                 RunConflictError, StewardError)
from sparksteward.ids import job_id_to_filename, validate_id, validate_job_id
from sparksteward.jobs.result import JobResult, JobResultEntry, StepState
from sparksteward.storage import open_location
from sparksteward.clock import SystemClock

__all__ = ["BlobJobDirCleanup", "CleanupOutcome", "CleanupRunner", "CleanupStep", "CleanupTask", "RetryPolicy",
           "StepExecutor", "StepRegistry", "delete_path", "normalize_path_target", "protect_path"]

log = logging.getLogger("sparksteward.jobs.cleanup")

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


# --- executors --------------------------------------------------------------------------------
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")  # s3://..., file:///..., and Hadoop's file:/...


def _is_relative_local(target: str) -> bool:
    return not _SCHEME.match(target) and not os.path.isabs(target)


def _protected_dirs() -> list[str]:
    """Local directories a cleanup step may never delete, nor any of their parents: the home dir and
    the steward state dir (read when checking, so a changed ``HOME``/``XDG_STATE_HOME`` counts)."""
    from sparksteward.config import default_state_dir  # config imports nothing of ours back

    out = [os.path.expanduser("~"), str(default_state_dir())]
    out.extend(_EXTRA_PROTECTED)
    return [os.path.normpath(os.path.abspath(p)) for p in out if p]


_EXTRA_PROTECTED: list[str] = []


def protect_path(path: str) -> None:
    """Refuse ``path`` (and its parents) as a cleanup target in this process, e.g. a configured state
    dir outside the default location."""
    if path and "://" not in path:
        norm = os.path.normpath(os.path.abspath(os.path.expanduser(path)))
        if norm not in _EXTRA_PROTECTED:
            _EXTRA_PROTECTED.append(norm)


def _refuse(target: str, rule: str) -> InvalidRecordError:
    return InvalidRecordError(f"refusing to delete {target!r}: {rule}. Register the directory the job "
                              f"wrote instead (an absolute path or URL without '.', '..' or '~')")


def _split(target: str) -> tuple[str | None, str]:
    """``(protocol or None for a plain local path, path)``; Hadoop's ``file:/x`` counts as ``file``."""
    if "://" in target:
        protocol, rest = target.split("://", 1)
        return protocol.lower(), rest
    m = _SCHEME.match(target)
    if m and len(m.group(0)) > 2:  # 'file:/tmp/x' (not a Windows drive letter such as 'C:')
        return target[: m.end() - 1].lower(), target[m.end():]
    return None, target


def normalize_path_target(target: str) -> str:
    """Check a ``delete_path`` target and return its normal form; InvalidRecordError naming the rule.

    Rules, checked on the text as given (nothing is resolved first): no ``~``; no ``.`` or ``..``
    component; absolute (or a URL). Then the normal form (repeated and trailing slashes removed) must
    not be a file-system root, a bucket (or any protocol's) root, the home dir, the steward state dir,
    or a parent of one of them.
    """
    if target.startswith("~"):
        raise _refuse(target, "a path starting with '~' depends on the user that runs the cleanup")
    protocol, path = _split(target)
    if path.startswith("~"):
        raise _refuse(target, "a path starting with '~' depends on the user that runs the cleanup")
    if any(part in (".", "..") for part in path.replace("\\", "/").split("/")):
        raise _refuse(target, "it has a '.' or '..' component, which could point anywhere")
    if protocol is None and not os.path.isabs(target):
        raise InvalidRecordError(f"cleanup path {target!r} is relative; give an absolute path or a URL, because the "
                                 f"cleanup may run in another process (the driver agent, a later driver)")
    local = protocol in (None, "file", "local")
    if local:
        if protocol is not None and path and not path.startswith("/"):  # file://host/path is not local
            raise _refuse(target, "a file:// URL must name an absolute local path (file:///dir)")
        norm = "/" + "/".join(p for p in path.split("/") if p)
        if norm == "/":
            raise _refuse(target, "it is the root of the file system")
        for protected in _protected_dirs():
            if protected == norm or protected.startswith(norm.rstrip("/") + "/"):
                raise _refuse(target, f"it is, or contains, a protected directory ({protected}: the home or the "
                                      f"steward state dir)")
        return norm if protocol is None else f"{protocol}://{norm}"
    parts = [p for p in path.split("/") if p]
    if len(parts) < 2:
        raise _refuse(target, f"it is the root of a bucket or of the {protocol}:// file system")
    return f"{protocol}://{'/'.join(parts)}"


def check_path_target(target: str) -> None:
    """Reject a ``delete_path`` target that :func:`normalize_path_target` refuses."""
    normalize_path_target(target)


def delete_path(target: str) -> None:
    """Delete a file or directory (recursively) at any fsspec URL or absolute path.

    A missing path is success, so running it twice is fine. The target is checked again right before
    deleting (:func:`normalize_path_target`), and for a local path its real path (symlinks resolved)
    is checked too, so a target edited or swapped after it was recorded is still refused.
    """
    norm = normalize_path_target(target)
    loc = open_location(norm)
    if loc.is_local:
        real = os.path.realpath(loc.root)
        if real != loc.root:
            try:
                normalize_path_target(real)
            except InvalidRecordError as exc:
                raise _refuse(target, f"it resolves through a symbolic link to {real!r}, which is refused: {exc}") \
                    from exc
    elif "/" not in loc.root.strip("/"):
        raise _refuse(target, "it is the root of a bucket")
    if loc.delete(loc.root, recursive=True):
        log.debug("deleted %s", target)


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


# --- retries ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """When to retry a failed step.

    ``exponential`` (the default): ``initial * 2**(failures-1)``, capped at ``maximum`` (1 s, 2 s,
    4 s, ... up to 1 h). ``fixed``: always ``initial``. ``attempts`` is the number of attempts per
    step in one run before giving up (0 = unlimited).
    """

    initial: float = 1.0
    maximum: float = 3600.0
    attempts: int = 0
    strategy: str = "exponential"

    def __post_init__(self) -> None:
        if self.strategy not in ("exponential", "fixed"):
            raise InvalidRecordError(f"retry strategy {self.strategy!r} is not 'exponential' or 'fixed'")
        if not self.initial > 0 or not self.maximum >= self.initial:
            raise InvalidRecordError(f"retry delays must satisfy 0 < initial <= maximum, not "
                                     f"initial={self.initial!r}, maximum={self.maximum!r}")
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 0:
            raise InvalidRecordError(f"retry attempts must be an integer >= 0 (0 = unlimited), not {self.attempts!r}")

    @classmethod
    def exponential(cls, initial: float = 1.0, maximum: float = 3600.0, attempts: int = 0) -> RetryPolicy:
        return cls(initial, maximum, attempts, "exponential")

    @classmethod
    def fixed(cls, delay: float = 60.0, attempts: int = 0) -> RetryPolicy:
        return cls(delay, delay, attempts, "fixed")

    @classmethod
    def from_config(cls, cfg: Any) -> RetryPolicy:
        """From ``spark.steward.cleanup.{initial-backoff,max-backoff,max-attempts}``."""
        return cls.exponential(cfg.cleanup_initial_backoff, max(cfg.cleanup_max_backoff, cfg.cleanup_initial_backoff),
                               cfg.cleanup_max_attempts)

    def delay(self, failures: int) -> float:
        """Seconds to wait after the ``failures``-th consecutive failure (1-based)."""
        if self.strategy == "fixed":
            return self.initial
        return min(self.initial * (2.0 ** min(max(0, failures - 1), 64)), self.maximum)

    def exhausted(self, attempts: int) -> bool:
        return self.attempts > 0 and attempts >= self.attempts


# --- the runner -------------------------------------------------------------------------------
class CleanupOutcome(str, enum.Enum):
    """How a cleanup run ended."""

    COMMITTED = "committed"  # every step done and the result marked clean (here or by another process)
    GAVE_UP = "gave_up"  # some step failed for good or ran out of attempts; the result stays dirty
    STOPPED = "stopped"  # the runner was stopped (shutdown); the result stays dirty for the next driver
    GONE = "gone"  # the dirty result disappeared (deleted); nothing left to do
    SUPERSEDED = "superseded"  # a newer (forced) run of the job id replaced this run's entry; nothing written


class CleanupTask:
    """The progress of one result's cleanup within one runner. Not thread-safe: one pass at a time.

    ``entry`` is the latest view of the result (clean once committed); ``outcome`` is set, and
    ``finished`` is set, when the run ends.
    """

    def __init__(self, result: JobResult, source: str = "") -> None:
        self.result = result
        self.entry = JobResultEntry(result, False, source)
        self.run_attempts = [0] * len(result.cleanup)
        self.permanent: set[int] = set()
        self.unsaved = False
        self.commit_failures = 0
        self.outcome: CleanupOutcome | None = None
        self.finished = threading.Event()
        self.lease: Any = None  # the live run's store lease, released when the run ends
        self.deferred = False  # a recovery waiting for a live run's lease (JobService)

    def end(self, outcome: CleanupOutcome) -> None:
        """Record how the run ended, release its lease and wake waiters (idempotent on the lease)."""
        self.outcome = outcome
        lease, self.lease = self.lease, None
        if lease is not None:
            try:
                lease.release()
            except Exception:  # noqa: BLE001 - a lease file that cannot be removed is released by close anyway
                log.warning("job %s: could not release its lease", self.job_id, exc_info=True)
        self.finished.set()

    @property
    def job_id(self) -> str:
        return self.result.job_id

    def __repr__(self) -> str:
        return f"CleanupTask({self.job_id!r}, {self.result.steps_done}/{len(self.result.cleanup)} done, {self.outcome})"


class CleanupRunner:
    """Runs the cleanup steps of dirty results and commits them. See the module docstring.

    Parameters
    ----------
    store
        The JobResultStore (writer side) holding the dirty results.
    registry
        Step kinds and their executors.
    policy
        When to retry failed steps (default: exponential, 1 s to 1 h, unlimited).
    clock
        ``now()`` and ``sleep()``; a fake clock makes backoff instantaneous in tests.
    stop
        Set it to make runs end (STOPPED) at the next step boundary or wait.

    Thread-safety: a runner may serve several threads, each running its own task.
    """

    def __init__(self, store: Any, registry: StepRegistry | None = None, policy: RetryPolicy | None = None,
                 clock: Any = None, stop: threading.Event | None = None) -> None:
        self.store = store
        self.registry = registry or StepRegistry()
        self.policy = policy or RetryPolicy()
        self.clock = clock or SystemClock()
        self.stop = stop or threading.Event()

    def run(self, what: JobResult | JobResultEntry | CleanupTask) -> CleanupOutcome:
        """Run a dirty result's cleanup in this thread until it commits, gives up or is stopped."""
        task = self.task(what)
        while True:
            due = self.run_pass(task)
            if due is None:
                return task.outcome  # type: ignore[return-value]
            if not self.wait(due - self.clock.now()):
                self._end(task, CleanupOutcome.STOPPED)
                return CleanupOutcome.STOPPED

    @staticmethod
    def task(what: JobResult | JobResultEntry | CleanupTask) -> CleanupTask:
        if isinstance(what, CleanupTask):
            return what
        if isinstance(what, JobResultEntry):
            return CleanupTask(what.result, what.source)
        return CleanupTask(what)

    def wait(self, seconds: float) -> bool:
        """Wait ``seconds`` (the system clock waits on ``stop``; other clocks ``sleep``); False if stopped."""
        if seconds > 0 and not self.stop.is_set():
            if isinstance(self.clock, SystemClock):
                self.stop.wait(seconds)
            else:
                self.clock.sleep(seconds)
        return not self.stop.is_set()

    def run_pass(self, task: CleanupTask) -> float | None:
        """Run every step that is due, record the states, and commit if all are done.

        Returns the clock time at which the next pass is due, or None when the run is over
        (``task.outcome`` says how).
        """
        if task.outcome is not None:
            return None
        steps = list(task.result.cleanup)
        for i, s in enumerate(steps):
            if self.stop.is_set():
                return self._end(task, CleanupOutcome.STOPPED)
            if not self._due(task, i, s):
                continue
            steps[i] = self._attempt(task, i, s)
            task.result = task.result.with_cleanup(steps)
            if self._save(task):
                return None
        if self.stop.is_set():  # a step that was running when the runner stopped: recorded, not committed
            return self._end(task, CleanupOutcome.STOPPED)
        if task.result.cleanup_done:
            return self._commit(task)
        live = [i for i, s in enumerate(steps)
                if not s.done and i not in task.permanent and not self._exhausted(task, i)]
        if not live:
            failed = [f"{s.kind} {s.target}: {s.last_error}" for s in steps if not s.done]
            log.error("job %s: cleanup gave up; the result stays dirty. Fix the cause, then run `steward jobs "
                      "cleanup` (failed steps: %s)", task.job_id, "; ".join(failed))
            if task.unsaved:
                self._save(task)
            return self._end(task, CleanupOutcome.GAVE_UP)
        if task.unsaved and self._save(task):
            return None
        return min(steps[i].next_attempt_at or self.clock.now() for i in live)

    # --- internals -----------------------------------------------------------------------------
    def _exhausted(self, task: CleanupTask, i: int) -> bool:
        return self.policy.exhausted(task.run_attempts[i])

    def _due(self, task: CleanupTask, i: int, s: StepState) -> bool:
        if s.done or i in task.permanent or self._exhausted(task, i):
            return False
        # a step this run has not tried yet is due now, whatever a previous driver planned
        return task.run_attempts[i] == 0 or s.next_attempt_at is None or s.next_attempt_at <= self.clock.now()

    def _attempt(self, task: CleanupTask, i: int, s: StepState) -> StepState:
        task.run_attempts[i] += 1
        attempts = s.attempts + 1
        try:
            self.registry.run(CleanupStep.of(s))
        except (InvalidRecordError, InvalidIdError) as exc:  # can never succeed in this process
            task.permanent.add(i)
            log.error("job %s: cleanup step %s %s cannot run: %s", task.job_id, s.kind, s.target, exc)
            return replace(s, state="failed", attempts=attempts, last_error=_describe(exc), next_attempt_at=None)
        except Exception as exc:  # noqa: BLE001 - executors are pluggable; any failure is retried
            if self._exhausted(task, i):
                log.error("job %s: cleanup step %s %s failed on attempt %d of %d, giving up: %s", task.job_id,
                          s.kind, s.target, task.run_attempts[i], self.policy.attempts, exc)
                return replace(s, state="failed", attempts=attempts, last_error=_describe(exc), next_attempt_at=None)
            delay = self.policy.delay(task.run_attempts[i])
            log.warning("job %s: cleanup step %s %s failed (attempt %d), retrying in %.3g s: %s", task.job_id,
                        s.kind, s.target, attempts, delay, exc)
            return replace(s, state="failed", attempts=attempts, last_error=_describe(exc),
                           next_attempt_at=self.clock.now() + delay)
        log.info("job %s: cleanup step %s %s done", task.job_id, s.kind, s.target)
        return replace(s, state="done", attempts=attempts, last_error=None, next_attempt_at=None)

    def _save(self, task: CleanupTask) -> bool:
        """Record the step states in the dirty result. True if the run is over (the entry is gone)."""
        try:
            task.entry = self.store.update_dirty(task.result)
            task.unsaved = False
        except JobResultNotFoundError:
            self._gone(task)
            return True
        except RunConflictError as exc:
            self._superseded(task, exc)
            return True
        except Exception as exc:  # noqa: BLE001 - a store outage must not stop the cleanup itself
            task.unsaved = True
            task.entry = JobResultEntry(task.result, False, task.entry.source)
            log.warning("job %s: could not record cleanup progress (will retry): %s", task.job_id, exc)
        return False

    def _commit(self, task: CleanupTask) -> float | None:
        try:
            if task.unsaved:  # the committed file should show every step done
                self.store.update_dirty(task.result)
                task.unsaved = False
            entry = self.store.mark_clean(task.job_id, task.result.run_id)
        except JobResultNotFoundError:
            return self._gone(task)
        except RunConflictError as exc:
            return self._superseded(task, exc)
        except CorruptRecordError as exc:
            log.error("job %s: cannot commit, the stored result is unreadable: %s", task.job_id, exc)
            return self._end(task, CleanupOutcome.GAVE_UP)
        except Exception as exc:  # noqa: BLE001 - retried like a step
            task.commit_failures += 1
            if self.policy.exhausted(task.commit_failures):
                log.error("job %s: commit failed %d times, giving up; the result stays dirty: %s", task.job_id,
                          task.commit_failures, exc)
                return self._end(task, CleanupOutcome.GAVE_UP)
            delay = self.policy.delay(task.commit_failures)
            log.warning("job %s: commit failed, retrying in %.3g s: %s", task.job_id, delay, exc)
            return self.clock.now() + delay
        task.entry = entry if entry is not None else JobResultEntry(task.result, True, "(deleted on commit)")
        log.info("job %s: cleanup committed (%d steps)", task.job_id, len(task.result.cleanup))
        return self._end(task, CleanupOutcome.COMMITTED)

    def _gone(self, task: CleanupTask) -> None:
        """The dirty file vanished: another process committed it, or someone deleted it."""
        try:
            current = self.store.get(task.job_id)
        except StewardError:
            current = None
        run_id = task.result.run_id
        if current is not None and run_id is not None and current.result.run_id not in (None, run_id):
            return self._superseded(task, None, current)
        if current is not None and current.clean:
            task.entry = current
            log.info("job %s: already committed by another process", task.job_id)
            return self._end(task, CleanupOutcome.COMMITTED)
        log.warning("job %s: its dirty result was deleted during cleanup; stopping", task.job_id)
        return self._end(task, CleanupOutcome.GONE)

    def _superseded(self, task: CleanupTask, exc: Exception | None, current: JobResultEntry | None = None) -> None:
        """A newer run of the job id owns the stored entry: stop without writing anything."""
        if current is None:
            try:
                current = self.store.get(task.job_id)
            except StewardError:
                current = None
        if current is not None:
            task.entry = current
        log.warning("job %s: run %s was superseded by run %s (a forced re-run); stopping its cleanup without "
                    "writing. The newer run carries its unfinished steps%s", task.job_id, task.result.run_id,
                    current.result.run_id if current is not None else "?", f" ({exc})" if exc else "")
        return self._end(task, CleanupOutcome.SUPERSEDED)

    @staticmethod
    def _end(task: CleanupTask, outcome: CleanupOutcome) -> None:
        task.end(outcome)
        return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:2000]
