"""``steward jobs list|show|cleanup|prune|quarantine`` on a JobResultStore path."""

from __future__ import annotations

import argparse
import datetime as _dt
from typing import Any

import orjson

from sparksteward.config import StewardConfig, parse_duration
from sparksteward.errors import ConfigError, JobResultNotFoundError
from sparksteward.jobs.cleanup import RetryPolicy, StepRegistry
from sparksteward.jobs.service import JobService
from sparksteward.jobs.store import FileSystemJobResultStore
from sparksteward.tables import table

__all__ = ["add_subcommands"]


def _service(args: argparse.Namespace) -> JobService:
    cfg = StewardConfig.from_conf({"spark.steward.cluster-id": args.cluster_id})
    store = FileSystemJobResultStore(args.path or cfg.effective_jrs_path, cfg.cluster_id)
    registry = StepRegistry(ha_root=args.ha_path or cfg.effective_ha_path, cluster_id=cfg.cluster_id)
    policy = RetryPolicy(1.0, 30.0, getattr(args, "attempts", 0))
    return JobService(store, cluster_id=cfg.cluster_id, registry=registry, policy=policy)


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")


def _list(args: argparse.Namespace) -> int:
    svc = _service(args)
    listing = svc.store.list()
    rows = [[e.job_id, e.status.value, e.state, _when(e.result.end_time),
             f"{sum(s.state == 'done' for s in e.result.cleanup)}/{len(e.result.cleanup)}",
             e.result.application_id or "-"]
            for e in listing.entries if args.state in ("all", e.state)]
    print(f"{len(rows)} job result(s) in {svc.store.base.url}")
    if rows:
        print(table(rows, ["JOB", "STATUS", "STATE", "ENDED", "CLEANUP", "APPLICATION"]))
    for path, why in listing.corrupt:
        print(f"unreadable: {path}: {why}")
    return 0


def _show(args: argparse.Namespace) -> int:
    entry = _service(args).get(args.job_id)
    if entry is None:
        raise JobResultNotFoundError(f"no result for job {args.job_id!r}")
    r = entry.result
    print(f"job:          {r.job_id}\ncluster:      {r.cluster_id}\napplication:  {r.application_id or '-'}")
    print(f"status:       {r.status.value} ({entry.state})\nstarted:      {_when(r.start_time)}")
    print(f"ended:        {_when(r.end_time)}\nfile:         {entry.source}")
    if r.failure:
        print(f"failure:      {r.failure.type}: {r.failure.message}\n              at {r.failure.where}")
    print(f"payload:      {orjson.dumps(r.payload).decode()}")
    print(f"spark jobs:   {len(r.spark_jobs)} ({sum(j.outcome == 'failed' for j in r.spark_jobs)} failed)")
    if r.cleanup:
        print(table([[s.kind, s.target, s.state, str(s.attempts), s.last_error or ""] for s in r.cleanup],
                     ["STEP", "TARGET", "STATE", "ATTEMPTS", "LAST ERROR"]))
    return 0


def _cleanup(args: argparse.Namespace) -> int:
    svc = _service(args)
    started = svc.recover()
    if not started:
        print("no dirty job results")
        return 0
    done = svc.wait_idle(args.timeout)
    svc.close(0)
    for job_id in started:
        entry = svc.get(job_id)
        print(f"{job_id}: {'clean' if entry is None or entry.clean else 'still dirty'}")
    return 0 if done else 1


def _prune(args: argparse.Namespace) -> int:
    try:
        age = parse_duration(args.older_than)
    except ValueError:
        raise ConfigError(f"--older-than {args.older_than!r} is not a duration such as 30d or 12h") from None
    pruned = _service(args).prune(age)
    print(f"pruned {len(pruned)} clean job result(s) older than {args.older_than}")
    return 0


def _quarantine(args: argparse.Namespace) -> int:
    print(f"moved to {_service(args).store.quarantine(args.name)}")
    return 0


def add_subcommands(sub: Any) -> None:
    """Add ``jobs`` with its subcommands to the ``steward`` parser."""
    jobs = sub.add_parser("jobs", help="inspect and maintain a JobResultStore")
    jsub = jobs.add_subparsers(dest="jobs_command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--path", help="store path or fsspec URL (default: the embedded local store)")
        p.add_argument("--cluster-id", default="default", help="cluster id namespace (default: default)")
        p.add_argument("--ha-path", help="HA blob store, for blob cleanup steps (default: the embedded one)")

    p = jsub.add_parser("list", help="list job results")
    common(p)
    p.add_argument("--state", choices=("all", "dirty", "clean"), default="all")
    p.set_defaults(func=_list)
    p = jsub.add_parser("show", help="show one job result")
    common(p)
    p.add_argument("job_id")
    p.set_defaults(func=_show)
    p = jsub.add_parser("cleanup", help="finish the cleanup of dirty results, then commit them")
    common(p)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to keep retrying (default 300)")
    p.add_argument("--attempts", type=int, default=0, help="attempts per step (default: unlimited)")
    p.set_defaults(func=_cleanup)
    p = jsub.add_parser("prune", help="delete clean results older than a duration")
    common(p)
    p.add_argument("--older-than", default="30d", help="duration such as 30d or 12h (default 30d)")
    p.set_defaults(func=_prune)
    p = jsub.add_parser("quarantine", help="move an unreadable result file aside")
    common(p)
    p.add_argument("name", help="a file name in the store (e.g. x_DIRTY.json) or a job id")
    p.set_defaults(func=_quarantine)
