"""``steward jobs list|show|cleanup|prune|quarantine`` on a JobResultStore path.

Every subcommand takes ``--path`` (a local path or fsspec URL; default: the embedded store under the
local state dir) and ``--cluster-id``. Expected failures raise a
:class:`~sparksteward.errors.StewardError`, which ``steward`` prints as one line, exiting with status 2.

``show`` prints the counts of a result's Spark jobs by outcome and lists only the last ``--limit``
of them (a stream runs thousands), naming the failed ones it does not list.
"""

from __future__ import annotations

import argparse
import collections
import datetime as _dt
import functools
import os
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from sparksteward.config import StewardConfig, parse_duration
from sparksteward.errors import ConfigError, JobResultNotFoundError, StewardError, StorageError
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import MAX_SPARK_JOBS, JobResultEntry, SparkJobOutcome
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.spool import SPOOL_DIR
from sparksteward.jobs.steps import StepRegistry
from sparksteward.tables import table

__all__ = ["add_subcommands"]


def _guard(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn a stray OSError into a one-line StewardError (the store normally does this itself)."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except StewardError:
            raise
        except OSError as exc:
            raise StorageError(f"{exc} (store {args.path or 'default'})") from exc

    return run


def _config(args: argparse.Namespace) -> StewardConfig:
    return StewardConfig.from_conf({"spark.steward.cluster-id": args.cluster_id})


def _store(args: argparse.Namespace) -> FileSystemJobResultStore:
    cfg = _config(args)
    path = args.path or cfg.effective_jrs_path
    if path == "memory":
        raise ConfigError("--path memory names the driver's in-memory store, which no other process can read; "
                          "give the store's path or URL")
    return FileSystemJobResultStore(path, cfg.cluster_id)


def _service(args: argparse.Namespace, attempts: int = 0, max_backoff: float = 30.0,
             initial_backoff: float = 1.0) -> JobService:
    cfg = _config(args)
    store = _store(args)
    registry = StepRegistry(args.ha_path or cfg.effective_ha_path, cfg.cluster_id)
    # this host's spool: results a driver here could not store are written to their store (only to it:
    # the spool is kept per store) by `steward jobs cleanup`, as by the next driver
    return JobService(store, cluster_id=cfg.cluster_id, registry=registry,
                      policy=RetryPolicy.exponential(initial_backoff, max(initial_backoff, max_backoff), attempts),
                      spool_dir=os.path.join(cfg.effective_state_dir, SPOOL_DIR))


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _steps(entry: JobResultEntry) -> str:
    return f"{entry.result.steps_done}/{len(entry.result.cleanup)}"


@_guard
def _list(args: argparse.Namespace) -> int:
    store = _store(args)
    listing = store.list(state=None if args.state == "all" else args.state, status=args.status)
    rows = [[e.job_id, e.status.value, e.state, _when(e.result.end_time), _steps(e), e.result.application_id or "-"]
            for e in listing.entries]
    print(f"{len(rows)} job result(s) in {store.url}")
    if rows:
        print(table(rows, ["JOB", "STATUS", "STATE", "ENDED", "CLEANUP", "APPLICATION"]))
    for path, why in listing.corrupt:
        print(f"unreadable: {path}: {why}")
    if listing.corrupt:
        print("move unreadable files aside with `steward jobs quarantine <file>`")
    if listing.stale:
        print(f"stale dirty files next to committed results (removed by `steward jobs cleanup`): "
              f"{', '.join(listing.stale)}")
    return 0


def _outcomes(jobs: Sequence[SparkJobOutcome]) -> str:
    """``<n>`` and its counts by outcome: ``1200 (1190 succeeded, 10 failed)``."""
    counts = collections.Counter(j.outcome for j in jobs)
    return (f"{len(jobs)}" + (f" ({', '.join(f'{n} {o}' for o, n in sorted(counts.items()))})" if counts else "")
            + (f"; a result keeps the first {MAX_SPARK_JOBS}" if len(jobs) >= MAX_SPARK_JOBS else ""))


def _ids(ids: list[str], most: int = 10) -> str:
    return ", ".join(ids[:most]) + (f" and {len(ids) - most} more" if len(ids) > most else "")


@_guard
def _show(args: argparse.Namespace) -> int:
    if args.limit < 0:
        raise ConfigError(f"--limit {args.limit} must be 0 (list every Spark job) or a positive number")
    entry = _store(args).get(args.job_id)
    if entry is None:
        raise JobResultNotFoundError(f"no result for job {args.job_id!r}")
    if args.json:
        print(orjson.dumps(entry.to_dict(), option=orjson.OPT_INDENT_2).decode())
        return 0
    r = entry.result
    fields = [("job", r.job_id), ("cluster", r.cluster_id), ("application", r.application_id or "-"),
              ("status", f"{r.status.value} ({entry.state})"), ("started", _when(r.start_time)),
              ("ended", f"{_when(r.end_time)} ({r.end_time - r.start_time:.1f} s)"), ("file", entry.source)]
    if r.failure:
        fields += [("failure", f"{r.failure.type}: {r.failure.message}"), ("where", r.failure.where or "-")]
    fields += [("payload", orjson.dumps(r.payload).decode()),
               ("spark jobs", _outcomes(r.spark_jobs)),
               ("cleanup", f"{_steps(entry)} steps done")]
    for name, value in fields:
        print(f"{name + ':':13} {value}")
    shown = r.spark_jobs[-args.limit:] if args.limit else r.spark_jobs
    if shown:
        print()
        if len(shown) < len(r.spark_jobs):
            hidden = r.spark_jobs[:len(r.spark_jobs) - len(shown)]
            failed = [str(j.spark_job_id) for j in hidden if j.outcome == "failed"]
            print(f"the last {len(shown)} of {len(r.spark_jobs)} Spark jobs"
                  + (f"; failed among the others: {_ids(failed)}" if failed else "")
                  + " (--limit 0 prints all, --json the whole record)")
        print(table([[j.spark_job_id, j.outcome, (j.reason or "").splitlines()[0][:80] if j.reason else ""]
                     for j in shown], ["SPARK JOB", "OUTCOME", "REASON"]))
    if r.cleanup:
        print()
        print(table([[s.kind, s.target, s.state, s.attempts,
                      _when(s.next_attempt_at) if s.next_attempt_at else "-", s.last_error or ""] for s in r.cleanup],
                    ["STEP", "TARGET", "STATE", "ATTEMPTS", "NEXT ATTEMPT", "LAST ERROR"]))
    return 0


@_guard
def _cleanup(args: argparse.Namespace) -> int:
    if not args.initial_backoff > 0:
        raise ConfigError(f"--initial-backoff {args.initial_backoff!r} must be a number of seconds > 0")
    svc = _service(args, attempts=args.attempts, max_backoff=min(args.timeout / 4, 3600.0),
                   initial_backoff=args.initial_backoff)
    with svc:
        started = svc.recover(only=args.job_ids or None, defer_leased=False)  # a live run finishes its own
        if not started:
            print("no dirty job results" + (f" among {', '.join(args.job_ids)}" if args.job_ids else ""))
            return 0
        print(f"cleaning up {len(started)} dirty job result(s) (up to {args.timeout:g} s)...")
        done = svc.wait_idle(args.timeout)
        svc.close(0)
    rows, left = [], 0
    for job_id in started:
        entry = svc.get(job_id)
        if entry is None or entry.clean:
            rows.append([job_id, "clean", _steps(entry) if entry else "-", ""])
            continue
        left += 1
        errors = [s.last_error for s in entry.result.cleanup if not s.done and s.last_error]
        rows.append([job_id, "still dirty", _steps(entry), (errors[0] if errors else "")[:100]])
    print(table(rows, ["JOB", "RESULT", "CLEANUP", "LAST ERROR"]))
    if left:
        print(f"{left} result(s) still dirty{'' if done else f' after {args.timeout:g} s'}; fix the cause and run "
              f"`steward jobs cleanup` again")
    return 1 if left else 0


@_guard
def _prune(args: argparse.Namespace) -> int:
    try:
        age = parse_duration(args.older_than)
    except ValueError:
        raise ConfigError(f"--older-than {args.older_than!r} is not a duration such as 30d, 12h or 90min") from None
    if age < 0:
        raise ConfigError(f"--older-than {args.older_than!r} must not be negative")
    svc = _service(args)
    if args.dry_run:
        cutoff = svc.clock.now() - age
        victims = [e.job_id for e in svc.list(state="clean", ended_before=cutoff).entries]
        print(f"would prune {len(victims)} clean job result(s) older than {args.older_than}"
              + (f": {', '.join(victims)}" if victims else ""))
        return 0
    pruned = svc.prune(older_than=age)
    print(f"pruned {len(pruned)} clean job result(s) older than {args.older_than}"
          + (f": {', '.join(pruned)}" if pruned else ""))
    return 0


@_guard
def _quarantine(args: argparse.Namespace) -> int:
    for moved in _store(args).quarantine(args.name):
        print(f"moved to {moved}")
    return 0


def add_subcommands(sub: Any) -> None:
    """Add ``jobs`` with its subcommands to the ``steward`` parser's subparsers."""
    jobs = sub.add_parser("jobs", help="inspect and maintain a JobResultStore",
                          description="Inspect and maintain a JobResultStore (FLIP-194).")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--path", help="store path or fsspec URL (default: the embedded store, "
                                      "<state-dir>/job-results)")
        p.add_argument("--cluster-id", default="default", help="cluster id namespace (default: default)")
        p.add_argument("--ha-path", help="HA storage root, for blob_job_dir cleanup steps (default: the "
                                         "embedded one)")

    p = jsub.add_parser("list", help="list job results as a table")
    common(p)
    p.add_argument("--state", choices=("all", "dirty", "clean"), default="all")
    p.add_argument("--status", choices=("SUCCEEDED", "FAILED", "CANCELLED"), type=str.upper)
    p.set_defaults(func=_list)

    p = jsub.add_parser("show", help="show one job result in full")
    common(p)
    p.add_argument("job_id")
    p.add_argument("--json", action="store_true", help="print the stored record as JSON")
    p.add_argument("--limit", type=int, default=20,
                   help="Spark jobs to list, the last ones (default 20; 0 lists all); counts by outcome are always shown")
    p.set_defaults(func=_show)

    p = jsub.add_parser("cleanup", help="finish the cleanup of dirty results, then commit them")
    common(p)
    p.add_argument("job_ids", nargs="*", metavar="JOB", help="only these jobs (default: every dirty result)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to keep retrying (default 300)")
    p.add_argument("--attempts", type=int, default=0, help="attempts per step (default: unlimited until --timeout)")
    p.add_argument("--initial-backoff", type=float, default=1.0,
                   help="seconds before the first retry of a failed step; doubles per failure (default 1)")
    p.set_defaults(func=_cleanup)

    p = jsub.add_parser("prune", help="delete clean results older than a duration")
    common(p)
    p.add_argument("--older-than", default="30d", help="duration such as 30d or 12h (default 30d)")
    p.add_argument("--dry-run", action="store_true", help="only print what would be deleted")
    p.set_defaults(func=_prune)

    p = jsub.add_parser("quarantine", help="move an unreadable result file aside")
    common(p)
    p.add_argument("name", help="a file name in the store (e.g. x_DIRTY.json) or a job id (all its files)")
    p.set_defaults(func=_quarantine)
