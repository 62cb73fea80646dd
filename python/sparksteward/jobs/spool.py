"""The result spool: job results that ``finish()`` could not store, kept on local disk until a
JobService on this host can.

Layout, one directory per store (a hash of the store's URL, so a result only ever goes to the store
it was meant for)::

    <state-dir>/job-spool/<cluster-id>/<store hash>/<job file stem>.<run id>.json

Each file is the result's own versioned JSON record (:meth:`JobResult.to_json`), written like every
durable file here: staged in the same directory, fsynced, renamed to its final name, then the
directory fsynced (:meth:`Location.write_atomic`). A file under a final name is therefore always
complete. Staged files left by a killed process are removed after :data:`STAGED_MAX_AGE` seconds.

Thread-safety: the methods touch only the file system; concurrent writers use distinct names (one per
run), and a reader of a file being removed sees it missing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import time
from collections.abc import Iterator

from sparksteward.errors import CorruptRecordError, StewardError
from sparksteward.ids import job_id_to_filename
from sparksteward.jobs.result import JobResult
from sparksteward.storage import open_location, read_regular

__all__ = ["ResultSpool", "SPOOL_DIR", "STAGED_MAX_AGE"]

log = logging.getLogger("sparksteward.jobs.spool")

SPOOL_DIR = "job-spool"
"""The spool's directory under the state dir."""
STAGED_MAX_AGE = 3600.0
"""Seconds after which a staged spool file left by a killed process is removed."""
_SUFFIX = ".json"


class ResultSpool:
    """Spooled results of one store.

    Parameters
    ----------
    root
        The spool directory (``<state-dir>/job-spool``).
    cluster_id
        The results' cluster id.
    store_url
        The URL of the store the results belong to.
    """

    def __init__(self, root: str, cluster_id: str, store_url: str) -> None:
        key = hashlib.sha256(store_url.encode()).hexdigest()[:16]
        self.location = open_location(root).child(cluster_id, key)
        self.store_url = store_url

    def __repr__(self) -> str:
        return f"ResultSpool({self.location.root!r} for {self.store_url!r})"

    def put(self, result: JobResult) -> str:
        """Spool ``result`` durably; returns the file's path. StorageError if it cannot be written."""
        path = self.location.path(f"{job_id_to_filename(result.job_id)}.{result.run_id}{_SUFFIX}")
        self.location.write_atomic(path, result.to_json())  # staged, fsynced, renamed, dir fsynced
        return path

    def paths(self) -> list[str]:
        """Every spooled file, oldest name first; removes old staged files left by a killed process."""
        root = self.location.root
        try:
            names = sorted(os.listdir(root))
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            path = os.path.join(root, name)
            if name.startswith("."):
                with contextlib.suppress(OSError):
                    st = os.lstat(path)
                    if name.endswith(".tmp") and stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > STAGED_MAX_AGE:
                        os.unlink(path)
                continue
            if name.endswith(_SUFFIX):
                out.append(path)
        return out

    @staticmethod
    def read(path: str) -> JobResult:
        """The result in ``path``: FileNotFoundError if gone, CorruptRecordError if unreadable."""
        try:
            data = read_regular(path)
        except Exception as exc:  # a FIFO, a symlink, an I/O error
            raise CorruptRecordError(f"spooled job result {path}: {exc}") from exc
        if data is None:
            raise FileNotFoundError(path)
        return JobResult.from_json(data, path)

    def results(self) -> Iterator[tuple[str, JobResult | StewardError]]:
        """``(path, result or the error reading it)`` for every spooled file still present."""
        for path in self.paths():
            try:
                yield path, self.read(path)
            except FileNotFoundError:
                continue
            except StewardError as exc:
                yield path, exc

    def for_job(self, job_id: str) -> list[tuple[str, JobResult]]:
        """The readable spooled results of ``job_id``."""
        stem = job_id_to_filename(job_id)
        out = []
        for path in self.paths():
            if os.path.basename(path)[: -len(_SUFFIX)].rsplit(".", 1)[0] != stem:
                continue
            try:
                result = self.read(path)
            except (FileNotFoundError, StewardError):
                continue
            if result.job_id == job_id:
                out.append((path, result))
        return out

    def remove(self, path: str) -> None:
        """Delete a spooled file (durably); a missing one is fine."""
        self.location.delete(path)
