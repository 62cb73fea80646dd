"""`steward checkpoints ls|show|read|gc|rm` on file:// and moto S3 checkpoint dirs, and the installed command."""

from __future__ import annotations

import sys

import orjson
import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.cli import main

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts
from tests.helpers.terminal import FakeTerminal


def _state(tmp_path, store_url):
    storage = CheckpointStorage.open(store_url, "clicks")
    coord = CheckpointCoordinator(storage, P, M)
    for n in range(2):
        run_batch(coord, storage, tmp_path, n, BATCHES[n])
        coord.complete(n)
    return storage


def test_ls_and_show(tmp_path, store_url, capsys):
    storage = _state(tmp_path, store_url)
    assert main(["checkpoints", "ls", store_url]) == 0
    out = capsys.readouterr().out
    assert "1 state(s)" in out and "clicks" in out and "0,1" in out
    assert main(["checkpoints", "show", store_url, "clicks"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint 1: parallelism 2, max parallelism 16" in out and "[0, 8)" in out
    assert main(["checkpoints", "show", store_url, "clicks", "--id", "0", "--json"]) == 0
    assert orjson.loads(capsys.readouterr().out) == storage.read_metadata(0).to_json()
    assert main(["checkpoints", "show", store_url, "clicks", "--id", "9"]) == 2
    assert "checkpoint 9 of state 'clicks' has no" in capsys.readouterr().err


def test_gc_deletes_only_old_unreferenced_files(tmp_path, store_url, capsys):
    storage = _state(tmp_path, store_url)
    before = storage.shared_files()
    storage.location.fs.pipe_file(storage.location.path("shared", "e" * 32), b"orphan")
    assert main(["checkpoints", "gc", store_url, "clicks"]) == 0  # too young for the default 1h
    assert "deleted 0" in capsys.readouterr().out
    assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s", "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[1:] == ["shared/" + "e" * 32]
    assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s"]) == 0
    assert "deleted 1" in capsys.readouterr().out
    assert storage.shared_files() == before
    storage.location.write_atomic(storage.metadata_path(5), b'{"version": 2}')
    assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s"]) == 2
    assert "not collecting garbage" in capsys.readouterr().err and storage.shared_files() == before


def test_gc_refuses_a_live_writer_and_its_in_flight_uploads_stay(tmp_path, store_url, capsys):
    """A writer's uploads that no record references yet (acked, not completed) are not orphans: gc refuses
    while the writer's lease may be live, naming it, even with --min-age 0s, and the checkpoint that
    completes on those uploads restores exactly."""
    from sparksteward.checkpoint.lease import StateLease

    storage = CheckpointStorage.open(store_url, "clicks")
    lease = StateLease(storage.location, "clicks", application="app-stream", ttl=60)
    lease.acquire()
    coord = CheckpointCoordinator(storage, P, M, lease=lease)
    run_batch(coord, storage, tmp_path, 0, BATCHES[0])
    coord.complete(0)
    run_batch(coord, storage, tmp_path, 1, BATCHES[1])   # uploaded and acked: in flight
    in_flight = storage.stored_files() - storage.read_metadata(0).physical_paths()
    assert in_flight
    for dry in ([], ["--dry-run"]):
        assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s", *dry]) == 2
        err = capsys.readouterr().err
        assert "not collecting garbage in state 'clicks'" in err and "application app-stream" in err, err
        assert len(err.splitlines()) == 1
    assert in_flight <= storage.stored_files()
    meta = coord.complete(1)
    assert stored_counts(storage, meta, tmp_path, "gc") == expected_counts(BATCHES[:2])
    lease.release()
    assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s"]) == 0
    assert "deleted" in capsys.readouterr().out
    assert stored_counts(storage, meta, tmp_path, "gc2") == expected_counts(BATCHES[:2])


def test_gc_holds_the_lease_while_it_deletes(tmp_path, store_url, capsys, monkeypatch):
    """A writer starting while gc deletes is refused, naming gc: gc lists and deletes under the state's lease."""
    from sparksteward.checkpoint.lease import StateLease, read_lease
    from sparksteward.errors import StateLeaseError

    storage = _state(tmp_path, store_url)
    orphans = {f"shared/{i:032x}" for i in range(3)}
    for p in orphans:
        storage.location.fs.pipe_file(storage.location.path(*p.split("/")), b"orphan")
    refused: list[str] = []
    real = CheckpointStorage.delete_files

    def delete(self, paths):
        if not refused:
            with pytest.raises(StateLeaseError) as exc:
                StateLease(storage.location, "clicks", application="late", ttl=60).acquire()
            refused.append(str(exc.value))
        return real(self, paths)

    monkeypatch.setattr(CheckpointStorage, "delete_files", delete)
    assert main(["checkpoints", "gc", store_url, "clicks", "--min-age", "0s"]) == 0
    assert "deleted 3 orphaned file(s)" in capsys.readouterr().out
    assert "steward checkpoints gc" in refused[0]
    assert not orphans & storage.stored_files() and read_lease(storage.location).released


def test_show_lists_the_declared_variables_and_read_decodes_one(tmp_path, store_url, capsys):
    from sparksteward.state.declared import resolve, value_state

    storage = CheckpointStorage.open(store_url, "typed")
    coord = CheckpointCoordinator(storage, P, M)
    coord.states = resolve(None, [value_state("count", "bigint", ttl=3600)])   # the untyped counts, declared
    for n in range(2):
        run_batch(coord, storage, tmp_path, n, BATCHES[n])
        coord.complete(n)
    assert storage.read_metadata(1).properties["states"]["variables"]["count"]["ttl_ms"] == 3_600_000
    assert main(["checkpoints", "show", store_url, "typed"]) == 0
    out = capsys.readouterr().out
    assert "STATE VARIABLE" in out and "count" in out and "3600 s (on_write)" in out
    assert main(["checkpoints", "read", store_url, "typed", "count", "--json", "--limit", "1000000"]) == 0
    rows = [orjson.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected: dict = {}
    for batch in BATCHES[:2]:
        for k in batch:
            expected[k] = expected.get(k, 0) + 1
    assert {r["key"]: r["value"] for r in rows} == expected
    assert main(["checkpoints", "read", store_url, "typed", "nope"]) == 2
    assert "no declared variable 'nope'; declared: count (value)" in capsys.readouterr().err


def test_read_shows_the_restored_subtasks_on_a_terminal(tmp_path, store_url, capsys, monkeypatch):
    _state(tmp_path, store_url)
    assert main(["checkpoints", "read", store_url, "clicks", "--limit", "1"]) == 0
    assert capsys.readouterr().err == ""   # no progress line off a terminal
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["checkpoints", "read", store_url, "clicks", "--limit", "1", "--id", "0"]) == 0
    # one report a subtask; the clock may skip the first but never the last, which ends the line
    shown = tty.getvalue()
    assert shown.endswith(f"\rrestoring clicks checkpoint 0: {P}/{P} subtasks\n") and shown.count("\n") == 1
    assert set(shown[1:-1].split("\r")) <= {f"restoring clicks checkpoint 0: {i}/{P} subtasks" for i in range(1, P + 1)}
    assert "KEY" in capsys.readouterr().out


def test_ls_defaults_to_the_embedded_checkpoint_dir(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    default = str(tmp_path / "xdg" / "spark-steward" / "checkpoints")
    assert main(["checkpoints", "ls"]) == 0   # a fresh machine: not an error (issue 40)
    out = capsys.readouterr().out
    assert out.startswith(f"0 state(s): no checkpoints yet in {default} (the default checkpoint dir")
    assert "spark.steward.checkpoint.dir" in out and "`steward checkpoints ls <dir>`" in out
    assert len(out.splitlines()) == 1
    _state(tmp_path, default)
    assert main(["checkpoints", "ls"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"1 state(s) in {default}/default") and "clicks" in out


def test_ls_of_a_missing_dir_or_cluster_is_an_error(tmp_path, store_url, capsys):
    missing = store_url + "-missing"
    assert main(["checkpoints", "ls", missing]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint dir {missing} " in err and ("does not exist" in err or "holds nothing" in err)
    _state(tmp_path, store_url)
    assert main(["checkpoints", "ls", store_url, "--cluster-id", "prod"]) == 2
    err = capsys.readouterr().err
    assert "no states of cluster id 'prod'" in err and "'default'" in err and "--cluster-id" in err


def test_rm_refuses_a_live_writer_then_deletes_the_state(tmp_path, store_url, capsys):
    from sparksteward.checkpoint.lease import StateLease

    storage = _state(tmp_path, store_url)
    files = storage.stored_files()
    lease = StateLease(storage.location, "clicks", application="app-stream", ttl=60)
    lease.acquire()
    assert main(["checkpoints", "rm", store_url, "clicks"]) == 2
    err = capsys.readouterr().err
    assert "not deleting state 'clicks'" in err and "app-stream" in err and len(err.splitlines()) == 1
    assert storage.checkpoint_ids() == [0, 1] and storage.stored_files() == files
    lease.release()
    assert main(["checkpoints", "rm", store_url, "clicks", "--dry-run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("would delete state 'clicks'") and "(chk-0, chk-1)" in out[0]
    assert sorted(out[1:]) == sorted(files)
    assert main(["checkpoints", "rm", store_url, "clicks"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"deleted state 'clicks' in {storage.url}: 2 checkpoint record(s) (chk-0, chk-1), "
                              f"{len(files)} data file(s)")
    assert "deleting the data files" not in out.err   # no progress line off a terminal
    if storage.location.is_local:
        assert main(["checkpoints", "ls", store_url]) == 0 and "0 state(s)" in capsys.readouterr().out
    else:   # no object is left under the dir, so it is not there
        assert main(["checkpoints", "ls", store_url]) == 2 and "holds nothing" in capsys.readouterr().err
    assert main(["checkpoints", "rm", store_url, "../clicks"]) == 2
    assert "state name '../clicks' is not valid" in capsys.readouterr().err


def test_the_installed_command(tmp_path):
    import os
    import subprocess
    import sys

    from sparksteward.checkpoint.lease import StateLease

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "XDG_STATE_HOME": str(tmp_path / "xdg")}

    def steward(*argv):
        return subprocess.run([sys.executable, "-m", "sparksteward", *argv], capture_output=True, text=True,
                              env=env, timeout=60)

    assert "checkpoints" in steward("--help").stdout
    helps = steward("checkpoints", "--help")
    assert helps.returncode == 0 and "rm" in helps.stdout and "ls" in helps.stdout
    assert "--dry-run" in steward("checkpoints", "rm", "--help").stdout
    assert "--limit" in steward("jobs", "show", "--help").stdout
    ls = steward("checkpoints", "ls")   # a fresh machine's default dir: no checkpoints yet, not an error
    assert ls.returncode == 0 and not ls.stderr and ls.stdout.startswith("0 state(s): no checkpoints yet in ")
    ls = steward("checkpoints", "ls", str(tmp_path / "no-such-dir"))   # a given dir that is not there: an error
    assert ls.returncode == 2 and "Traceback" not in ls.stderr and "does not exist" in ls.stderr
    url = str(tmp_path / "chk")
    storage = _state(tmp_path, url)
    lease = StateLease(storage.location, "clicks", application="app-stream", ttl=60)
    lease.acquire()   # held by this (live) test process
    rm = steward("checkpoints", "rm", url, "clicks")
    assert rm.returncode == 2 and "Traceback" not in rm.stderr and "app-stream" in rm.stderr
    lease.release()
    rm = steward("checkpoints", "rm", url, "clicks")
    assert rm.returncode == 0 and rm.stdout.startswith("deleted state 'clicks'") and rm.stderr == ""
    assert not os.path.exists(storage.location.root)
