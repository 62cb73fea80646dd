"""``steward blobs ls|gc|put|get`` on an HA blob storage path.

- ``ls``: the blobs per job, with their sizes;
- ``gc``: delete the blobs of jobs that reached a final state (``--include-unowned``: also those of no job);
- ``put <file> --ha <path>``: upload a jar or file ahead of time as a permanent blob (deduplicated by
  content) and print its cluster-scoped ``steward://`` URL;
- ``get <url> --ha <path> --out <file>``: read a ``put`` URL's blob into a local file, verified (what the
  shim runs for ``spark-submit --jars steward://...`` in client mode).

On a terminal, ``put`` and ``get`` show the bytes transferred in a progress line on stderr: ``get``
after each chunk it reads, ``put`` to an object store as fsspec reports the upload (per part of a
multipart upload) and to a local store once the blob is stored. Off a terminal they write no progress
line (the shim reads ``get``'s output through a pipe).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.store import FileSystemBlobStore, job_dir_name
from sparksteward.blob.url import BlobUrl, cluster_scope, validate_file_name
from sparksteward.config import StewardConfig
from sparksteward.errors import BlobNotFoundError, BlobScopeError, ChecksumMismatchError, ConfigError, InvalidIdError
from sparksteward.hashing import hash_file
from sparksteward.ids import validate_job_id
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.progress import TerminalProgress
from sparksteward.tables import table

__all__ = ["add_subcommands", "get", "put"]


def _store(args: argparse.Namespace) -> tuple[FileSystemBlobStore, StewardConfig]:
    cfg = StewardConfig.from_conf({"spark.steward.cluster-id": args.cluster_id})
    path = args.path or cfg.effective_ha_path
    if path is None:
        raise ConfigError("the HA blob store is off (spark.steward.blob.ha.storage-path=none); give its path with --path")
    return FileSystemBlobStore(path, cfg.cluster_id), cfg


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _ls(args: argparse.Namespace) -> int:
    store, _ = _store(args)
    rows, total = [], 0
    for job in sorted(store.jobs(), key=lambda j: (j is not None, j or "")):
        for key, size in store.keys(job):
            rows.append((job_dir_name(job), str(key), "permanent" if key.permanent else "transient", _size(size)))
            total += size
    print(f"{len(rows)} blob(s), {_size(total)}, in {store.base.display(store.base.root)}")
    if rows:
        print(table(rows, ("JOB", "KEY", "TYPE", "SIZE")))
    return 0


def _gc(args: argparse.Namespace) -> int:
    store, cfg = _store(args)
    results = FileSystemJobResultStore(args.jrs_path or cfg.effective_jrs_path, cfg.cluster_id)
    collected = kept = 0
    for job in store.jobs():
        entry = results.get(job) if job is not None else None
        final = entry is not None
        if final or (job is None and args.include_unowned):
            blobs = store.keys(job)
            action = "would delete" if args.dry_run else "deleted"
            if not args.dry_run:
                store.delete_job(job)
            print(f"{action} {job_dir_name(job)}: {len(blobs)} blob(s) "
                  f"({'job ' + entry.status.value + ', ' + entry.state if entry else 'no job'})")
            collected += 1
        else:
            kept += 1
    print(f"{'would collect' if args.dry_run else 'collected'} {collected} job director(ies); kept {kept} "
          f"of jobs that are not final (they may still be recovered)")
    return 0


def put(file: str | os.PathLike[str], ha: str, cluster_id: str = "default", job: str | None = None, *,
        progress: Callable[[int, int], None] | None = None) -> str:
    """Upload ``file`` ahead of time as a permanent blob to the HA store ``ha``; return its steward:// URL.

    What ``steward blobs put`` runs. Dedup is by content: a file already stored transfers nothing.
    ``progress(sent, size)`` reports the upload's bytes (:meth:`FileSystemBlobStore.put`).
    """
    src = Path(file)
    name = validate_file_name(src.name)
    if not src.is_file():
        raise InvalidIdError(f"{str(file)!r} is not a file")
    job = None if job is None else validate_job_id(job)
    store, cfg = _store(argparse.Namespace(path=ha, cluster_id=cluster_id))
    with tempfile.TemporaryDirectory(prefix="steward-put-") as tmp:
        copy = Path(tmp) / name  # hash and upload the same bytes, even if the file changes meanwhile
        shutil.copyfile(src, copy)
        key = BlobKey(BlobType.PERMANENT, hash_file(copy))
        if store.exists(job, key):
            print(f"{key} is already stored in {store.base.display(store.base.root)} (job {job_dir_name(job)}): "
                  "0 bytes transferred", file=sys.stderr)
        else:
            store.put(job, key, copy, progress=progress)
            print(f"uploaded {name} ({_size(os.path.getsize(copy))}) as {key} to "
                  f"{store.base.display(store.base.root)} (job {job_dir_name(job)})", file=sys.stderr)
    return str(BlobUrl(cluster_scope(cfg.cluster_id), job, key, name))


def _put(args: argparse.Namespace) -> int:
    """Upload a file ahead of time as a permanent blob and print its cluster-scoped steward:// URL."""
    with TerminalProgress(f"uploading {Path(args.file).name}", as_bytes=True) as progress:
        url = put(args.file, args.path, args.cluster_id, args.job, progress=progress)
    print(url)
    return 0


def get(url: str, ha: str, out: str | os.PathLike[str], *,
        progress: Callable[[int, int], None] | None = None) -> Path:
    """Read the blob of a ``steward blobs put`` URL from the HA store ``ha``, verified, into ``out``.

    What the shim's file system runs where no agent runs yet (``spark-submit --jars`` in client mode
    fetches the jars before the SparkContext starts). The copy is staged next to ``out`` and renamed
    into place only once it matches the key; nothing is written otherwise. ``progress(copied, size)``
    reports the bytes read (:meth:`FileSystemBlobStore.get`).
    """
    blob = BlobUrl.parse(url)
    fix = f"upload the file again with `steward blobs put <file> --ha {ha}` and pass the URL it prints"
    if blob.cluster_id is None:
        raise BlobScopeError(f"{url} belongs to the application that added it (st.add_jar/st.add_file): only "
                             "its agents can read it; for spark-submit --jars use a URL of `steward blobs put`")
    store = FileSystemBlobStore(ha, blob.cluster_id)
    where = f"the HA store {store.base.display(store.base.root)} (cluster {blob.cluster_id!r})"
    dest = Path(out)
    try:
        store.get(blob.job_id, blob.key, dest, progress=progress)
    except ChecksumMismatchError as exc:
        raise ChecksumMismatchError(f"{url}: {exc}: {fix}") from exc
    except FileNotFoundError as exc:
        raise BlobNotFoundError(f"{url}: no blob {blob.key} in {where}: pass the HA path `steward blobs put` "
                                f"used, or {fix}") from exc
    return dest


def _get(args: argparse.Namespace) -> int:
    """Fetch one steward:// URL from the HA store into a local file, verified; print the file's path."""
    with TerminalProgress(f"fetching {args.url.rsplit('/', 1)[-1]}", as_bytes=True) as progress:
        dest = get(args.url, args.path, args.out, progress=progress)
    print(dest)
    return 0


def add_subcommands(sub: Any) -> None:
    """Add ``blobs`` with ``ls`` and ``gc`` to the ``steward`` parser."""
    blobs = sub.add_parser("blobs", help="inspect and collect blobs in an HA storage path")
    bsub = blobs.add_subparsers(dest="blobs_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--path", help="HA blob storage path or fsspec URL (default: the embedded one)")
        p.add_argument("--cluster-id", default="default")

    p = bsub.add_parser("ls", help="list blobs per job")
    common(p)
    p.set_defaults(func=_ls)
    p = bsub.add_parser("gc", help="delete the blobs of jobs that reached a final state")
    common(p)
    p.add_argument("--jrs-path", help="JobResultStore path that says which jobs are final (default: embedded)")
    p.add_argument("--include-unowned", action="store_true", help="also delete blobs that belong to no job")
    p.add_argument("--dry-run", action="store_true", help="only say what would be deleted")
    p.set_defaults(func=_gc)
    p = bsub.add_parser("put", help="upload a jar or file ahead of time; print its steward:// URL (for --jars, "
                                    "--files, spark.jars)")
    p.add_argument("file")
    p.add_argument("--ha", "--path", dest="path", required=True,
                   help="the HA blob storage path or fsspec URL the applications use (spark.steward.blob.ha.storage-path)")
    p.add_argument("--cluster-id", default="default", help="the applications' spark.steward.cluster-id")
    p.add_argument("--job", help="tie the blob to this job id: the job's end deletes it (default: no job; kept "
                                 "until `steward blobs gc --include-unowned`)")
    p.set_defaults(func=_put)
    p = bsub.add_parser("get", help="read a `blobs put` URL from the HA store into a local file, verified "
                                    "(what spark-submit runs for --jars steward://... in client mode)")
    p.add_argument("url")
    p.add_argument("--ha", "--path", dest="path", required=True, help="the HA blob storage path or fsspec URL")
    p.add_argument("--out", required=True, help="the local file to write (staged, then renamed into place)")
    p.set_defaults(func=_get)
