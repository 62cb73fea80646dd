"""Durable commits: the fsyncs happen, in the right order, around real renames, links and unlinks
(issue 7 item 9).

A staged file must be fsynced before it is renamed or linked to its final name, and the directory
must be fsynced after each link, rename or unlink that commits state; otherwise a power loss can
leave an empty file under the final name, or lose the new name. ``os.fsync``, ``os.replace``,
``os.link`` and ``os.unlink`` are wrapped only to record the calls (with the path each fd names);
the calls themselves run for real on real files.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.result import JobResult, JobStatus, StepState
from sparksteward.storage import open_location


@pytest.fixture()
def calls(monkeypatch, tmp_path):
    """Every fsync/replace/link/unlink/rename under ``tmp_path``, in order: (op, path[, path])."""
    log: list[tuple[str, ...]] = []
    inside = str(tmp_path)

    def record(entry: tuple[str, ...]) -> None:
        if any(p.startswith(inside) for p in entry[1:]):
            log.append(entry)

    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link
    real_unlink, real_rename, real_remove = os.unlink, os.rename, os.remove

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}")
        real_fsync(fd)
        record(("fsync", path))

    def replace(src, dst, **kw):
        real_replace(src, dst, **kw)
        record(("replace", os.fsdecode(src), os.fsdecode(dst)))

    def link(src, dst, **kw):
        real_link(src, dst, **kw)
        record(("link", os.fsdecode(src), os.fsdecode(dst)))

    def unlink(path, **kw):
        real_unlink(path, **kw)
        record(("unlink", os.fsdecode(path)))

    def remove(path, **kw):
        real_remove(path, **kw)
        record(("unlink", os.fsdecode(path)))

    def rename(src, dst, **kw):
        real_rename(src, dst, **kw)
        record(("rename", os.fsdecode(src), os.fsdecode(dst)))

    for name, fn in {"fsync": fsync, "replace": replace, "link": link, "unlink": unlink, "remove": remove,
                     "rename": rename}.items():
        monkeypatch.setattr(os, name, fn)
    return log


def _index(log, entry) -> int:
    assert entry in log, f"{entry} was not called; calls: {log}"
    return log.index(entry)


def _staged_then(log, op: str, final: str) -> tuple[int, int]:
    """The index of ``op`` (replace/link) to ``final`` and of the fsync of its staged source."""
    moves = [(i, c) for i, c in enumerate(log) if c[0] == op and c[2] == final]
    assert moves, f"no {op} to {final}; calls: {log}"
    i, (_, staged, _) = moves[-1]
    synced = [j for j, c in enumerate(log) if c == ("fsync", staged)]
    assert synced and synced[-1] < i, f"{staged} was not fsynced before the {op} to {final}; calls: {log}"
    return i, synced[-1]


def _dir_synced_after(log, i: int, directory: str) -> None:
    later = [c for c in log[i + 1:] if c == ("fsync", directory)]
    assert later, f"{directory} was not fsynced after {log[i]}; calls: {log}"


def test_write_atomic_fsyncs_the_staged_file_then_renames_then_fsyncs_the_dir(tmp_path, calls):
    loc = open_location(str(tmp_path))
    target = str(tmp_path / "d" / "f.json")
    loc.write_atomic(target, b"old")
    calls.clear()
    loc.write_atomic(target, b"new")
    i, _ = _staged_then(calls, "replace", target)
    _dir_synced_after(calls, i, str(tmp_path / "d"))
    assert Path(target).read_bytes() == b"new"


def test_create_exclusive_fsyncs_the_staged_file_then_links_then_fsyncs_the_dir(tmp_path, calls):
    loc = open_location(str(tmp_path))
    target = str(tmp_path / "x.json")
    assert loc.create_exclusive(target, b"data")
    i, _ = _staged_then(calls, "link", target)
    _dir_synced_after(calls, i, str(tmp_path))
    assert Path(target).read_bytes() == b"data"


def test_rename_fsyncs_both_directories_after_the_rename(tmp_path, calls):
    loc = open_location(str(tmp_path))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "f").write_bytes(b"x")
    calls.clear()
    loc.rename(str(tmp_path / "a" / "f"), str(tmp_path / "b" / "f"))
    i = _index(calls, ("replace", str(tmp_path / "a" / "f"), str(tmp_path / "b" / "f")))
    _dir_synced_after(calls, i, str(tmp_path / "b"))
    _dir_synced_after(calls, i, str(tmp_path / "a"))


def test_delete_fsyncs_the_directory_after_the_unlink(tmp_path, calls):
    loc = open_location(str(tmp_path))
    (tmp_path / "f").write_bytes(b"x")
    calls.clear()
    assert loc.delete(str(tmp_path / "f"))
    i = _index(calls, ("unlink", str(tmp_path / "f")))
    _dir_synced_after(calls, i, str(tmp_path))


def _result(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED,
                     start_time=1.0, end_time=2.0, cleanup=(StepState("delete_path", "/x/y"),), run_id="r1")


def test_store_create_update_and_commit_are_durable_in_order(tmp_path, calls):
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    d = str(tmp_path / "jrs" / "default")
    dirty, clean = f"{d}/j_DIRTY.json", f"{d}/j.json"
    store.create_dirty(_result("j"))
    i, _ = _staged_then(calls, "link", dirty)
    _dir_synced_after(calls, i, d)

    calls.clear()
    store.update_dirty(_result("j").with_cleanup([StepState("delete_path", "/x/y", state="done", attempts=1)]))
    i, _ = _staged_then(calls, "replace", dirty)
    _dir_synced_after(calls, i, d)

    calls.clear()
    store.mark_clean("j", "r1")
    link = _index(calls, ("link", dirty, clean))  # the dirty file was fsynced when it was written
    unlink = _index(calls, ("unlink", dirty))
    assert link < unlink, calls
    between = calls[link + 1:unlink]
    assert ("fsync", d) in between, f"the clean name was not made durable before the dirty one was removed: {calls}"
    _dir_synced_after(calls, unlink, d)
    assert store.get("j").clean
