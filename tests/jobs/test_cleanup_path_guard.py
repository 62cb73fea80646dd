"""``delete_path`` refuses targets that would delete far more than asked (issue 7 item 2, must-show 3).

Targets are checked when a step is recorded and again right before deleting, on real files.

SAFETY: the code before the fix deletes ``~`` (the real home dir) and ``/tmp/..`` (the whole file
system) when asked. Every test here therefore runs in a sandbox: ``HOME`` and ``XDG_STATE_HOME`` point
into ``tmp_path``, and ``Location.delete`` is wrapped so that it refuses (with an AssertionError, which
fails the test) any path outside ``tmp_path``. The deletion itself is not what is under test; the
guard in front of it is. Never remove this sandbox: running these tests against unfixed code without
it destroyed a machine's /root and /etc.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import orjson
import pytest
from sparksteward.errors import InvalidRecordError
from sparksteward.jobs.cleanup import CleanupOutcome, CleanupRunner
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.pathguard import delete_path
from sparksteward.jobs.result import JobResult, JobStatus, StepState
from sparksteward.jobs.retry import RetryPolicy
from sparksteward.jobs.service import JobService
from sparksteward.jobs.steps import CleanupStep, StepRegistry
from sparksteward.storage import Location
from sparksteward.testing.clock import FakeClock


@pytest.fixture(autouse=True)
def _sandbox(tmp_path: Path, monkeypatch):
    """See the module docstring: nothing outside ``tmp_path`` can be deleted by any test here."""
    home, state = tmp_path / "sandbox-home", tmp_path / "sandbox-state"
    home.mkdir()
    state.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    real_delete = Location.delete
    inside = os.path.realpath(tmp_path) + os.sep

    def guarded_delete(self, path, recursive=False):
        full = os.path.realpath(os.path.normpath(str(path))) if self.is_local else None
        if full is None or not full.startswith(inside):
            raise AssertionError(f"the guard let a delete of {path!r} through (blocked by the test sandbox)")
        return real_delete(self, path, recursive)

    monkeypatch.setattr(Location, "delete", guarded_delete)

    # Belt and braces: the primitives below Location.delete (os.unlink/remove/rmdir, shutil.rmtree,
    # which fsspec's LocalFileSystem.rm uses) refuse anything outside tmp_path too. shutil.rmtree calls
    # them with dir_fd and a bare name: the directory is resolved through /proc/self/fd.
    def check(path, dir_fd=None):
        path = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(path):
            path = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        full = os.path.realpath(os.path.dirname(os.path.abspath(path)))
        if not (full + os.sep).startswith(inside):
            raise AssertionError(f"a delete of {path!r} reached the file system (blocked by the test sandbox)")

    for name in ("unlink", "remove", "rmdir"):
        real = getattr(os, name)

        def guarded(path, *, dir_fd=None, _real=real):
            check(path, dir_fd)
            return _real(path, dir_fd=dir_fd)

        monkeypatch.setattr(os, name, guarded)
    real_rmtree = shutil.rmtree

    def guarded_rmtree(path, *args, **kwargs):
        full = os.path.realpath(os.path.abspath(os.fsdecode(path)))
        if not (full + os.sep).startswith(inside) or full + os.sep == inside:
            raise AssertionError(f"rmtree of {path!r} (blocked by the test sandbox)")
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", guarded_rmtree)


@pytest.fixture()
def base(tmp_path: Path) -> Path:
    b = tmp_path / "base"
    (b / "a" / "b").mkdir(parents=True)
    (b / "keep.txt").write_text("keep")
    return b


# (target, the rule its message must name)
REFUSED = [
    ("/", "root"),
    ("/.", "'.' or '..' component"),
    ("/tmp/..", "'.' or '..' component"),
    ("file:///tmp/..", "'.' or '..' component"),
    ("~", "'~'"),
    ("~/", "'~'"),
    ("s3://bucket", "root of a bucket"),
    ("s3://bucket/", "root of a bucket"),
    ("{base}/a/../..", "'.' or '..' component"),
]


@pytest.mark.parametrize("target, rule", REFUSED, ids=[t for t, _ in REFUSED])
def test_delete_path_refuses_dangerous_targets(base, target, rule):
    target = target.format(base=base)
    registry = StepRegistry()
    with pytest.raises(InvalidRecordError) as info:
        delete_path(target)
    message = str(info.value)
    assert repr(target) in message and rule in message, message
    with pytest.raises(InvalidRecordError, match="refusing"):  # also when the step is recorded
        registry.validate(CleanupStep("delete_path", target))
    assert (base / "keep.txt").exists() and (base / "a" / "b").is_dir()


@pytest.mark.parametrize("protected", ["home", "state"])
def test_delete_path_refuses_the_home_and_state_dirs_and_their_parents(tmp_path, monkeypatch, protected):
    home = tmp_path / "home" / "user"
    state = tmp_path / "state-root" / "spark-steward"
    for d in (home, state):
        d.mkdir(parents=True)
        (d / "x").write_text("x")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_STATE_HOME", str(state.parent))
    d = home if protected == "home" else state
    for target in (str(d), str(d) + "/", str(d.parent), f"file://{d}"):
        with pytest.raises(InvalidRecordError, match="protected") as info:
            delete_path(target)
        assert repr(target) in str(info.value)
    assert (d / "x").exists()
    delete_path(str(d / "x"))  # inside them is fine
    assert not (d / "x").exists()


def test_targets_are_normalised_when_recorded(tmp_path):
    svc = JobService(FileSystemJobResultStore(str(tmp_path / "jrs")), clock=FakeClock())
    with svc:
        svc.begin("j")
        svc.add_cleanup_step("j", CleanupStep("delete_path", f"{tmp_path}//out///part/"))
        svc.add_cleanup_step("j", CleanupStep("delete_path", f"file://{tmp_path}//other/"))
        entry = svc.finish("j", "SUCCEEDED", wait=0)
    assert [s.target for s in entry.result.cleanup] == [f"{tmp_path}/out/part", f"file://{tmp_path}/other"]


def test_a_target_changed_on_disk_after_recording_is_checked_again_before_deleting(tmp_path, base):
    """A good target recorded, then the stored step edited to '/' (or a '..' path): refused at delete time."""
    store = FileSystemJobResultStore(str(tmp_path / "jrs"))
    good = base / "a" / "b"
    registry = StepRegistry()
    registry.validate(CleanupStep("delete_path", str(good)))
    result = JobResult(job_id="swap", cluster_id="default", application_id=None, status=JobStatus.SUCCEEDED,
                       start_time=1.0, end_time=2.0,
                       cleanup=(StepState("delete_path", str(good)), StepState("delete_path", str(base / "keep.txt"))))
    entry = store.create_dirty(result)
    path = entry.source
    doc = orjson.loads(Path(path).read_bytes())
    doc["result"]["cleanup"][0]["target"] = "/"
    doc["result"]["cleanup"][1]["target"] = f"{good}/../.."
    Path(path).write_bytes(orjson.dumps(doc))
    runner = CleanupRunner(store, registry, RetryPolicy.fixed(1.0, attempts=2), FakeClock())
    outcome = runner.run(store.get("swap"))
    assert outcome is CleanupOutcome.GAVE_UP
    steps = store.get("swap").result.cleanup
    assert [s.state for s in steps] == ["failed", "failed"]
    assert "refusing to delete '/'" in steps[0].last_error and "root" in steps[0].last_error
    assert "'.' or '..' component" in steps[1].last_error
    assert good.is_dir() and (base / "keep.txt").exists() and os.path.isdir("/tmp")


def test_the_sandbox_itself_blocks_deletes_outside_tmp_path(tmp_path):
    """The sandbox must hold even if the guard is broken (nothing here exists, nothing is touched)."""
    from sparksteward.storage import open_location

    outside = "/nonexistent-steward-sandbox-check/x"
    loc = open_location("/nonexistent-steward-sandbox-check")
    for attempt in (lambda: loc.delete(outside, recursive=True), lambda: os.unlink(outside),
                    lambda: os.rmdir(outside), lambda: shutil.rmtree(outside), lambda: os.remove("/tmp/../x")):
        with pytest.raises(AssertionError, match="sandbox"):
            attempt()
    (tmp_path / "ok").write_text("x")
    os.unlink(tmp_path / "ok")  # inside is allowed
