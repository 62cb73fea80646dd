"""`steward checkpoints savepoint` on file:// and moto S3: a savepoint of a completed checkpoint that
restores exactly, a progress line only on a terminal, and one-line errors for bad input."""

from __future__ import annotations

import os
import sys

import pytest
from sparksteward.checkpoint.coordination.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.lease import StateLease
from sparksteward.checkpoint.restore import restore_from
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.cli import main
from sparksteward.storage import open_location

from tests.helpers.checkpoint import BATCHES, M, P, expected_counts, run_batch, stored_counts
from tests.helpers.terminal import FakeTerminal

pytestmark = pytest.mark.usefixtures("deletes_stay_in_tmp_path")


def _state(tmp_path, store_url, name="clicks", complete=2):
    storage = CheckpointStorage.open(store_url, name)
    coord = CheckpointCoordinator(storage, P, M)
    for n in range(max(complete, 1)):
        run_batch(coord, storage, tmp_path / name, n, BATCHES[n])
        if n < complete:
            coord.complete(n)
    return storage


def _error(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_savepoint_restores_exactly(tmp_path, store_url, capsys):
    storage = _state(tmp_path, store_url)
    before = storage.stored_files()
    latest, older = store_url + "-savepoints/latest", store_url + "-savepoints/clicks-0"
    assert main(["checkpoints", "savepoint", store_url, "clicks", latest]) == 0
    out = capsys.readouterr()
    assert out.out.endswith("latest/_metadata\n") and len(out.out.splitlines()) == 1 and "://" in out.out
    assert out.err.startswith("saved state 'clicks' checkpoint 1 (") and "copying" not in out.err  # a pipe
    assert main(["checkpoints", "savepoint", store_url, "clicks", older, "--checkpoint", "0"]) == 0
    assert "checkpoint 0" in capsys.readouterr().err
    assert storage.stored_files() == before and storage.checkpoint_ids() == [0, 1]   # the source is untouched

    for url, batches, tag in ((out.out.strip(), BATCHES[:2], "l"), (older, BATCHES[:1], "o")):
        dst = CheckpointStorage.open(store_url, f"from-{tag}")
        restored = restore_from(url, dst, max_parallelism=M)
        assert restored.properties["savepoint_of"].endswith(f"/clicks/chk-{1 if tag == 'l' else 0}/_metadata")
        assert stored_counts(dst, restored, tmp_path, tag) == expected_counts(batches)


def test_the_progress_line_shows_on_a_terminal(tmp_path, store_url, capsys, monkeypatch):
    storage = _state(tmp_path, store_url)
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["checkpoints", "savepoint", store_url, "clicks", store_url + "-savepoints/tty"]) == 0
    files = len({f.path for f in storage.read_metadata(1).files()})
    shown = tty.getvalue().split("\n")
    assert shown[0].startswith("\rcopying clicks checkpoint 1: ") and shown[0].endswith(f": {files}/{files}")
    assert shown[1].startswith("saved state 'clicks' checkpoint 1") and shown[1].endswith(" 0 bytes streamed)")


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, store_url, capsys):
    storage = _state(tmp_path, store_url)
    _state(tmp_path, store_url, "pending", complete=0)
    sp = store_url + "-savepoints/sp"
    sp_loc = open_location(sp)
    cases = [
        (["nope", sp], "no state 'nope' of cluster id 'default' in"),
        (["clicks", sp, "--cluster-id", "prod"], "no state 'clicks' of cluster id 'prod' in"),
        (["../clicks", sp], "state name '../clicks' is not valid"),
        (["pending", sp], "state 'pending' has no completed checkpoint in"),
        (["clicks", sp, "--checkpoint", "9"], "checkpoint 9 of state 'clicks' has no"),
        (["clicks", store_url + "/sp"], "overlaps its checkpoint dir"),
        (["clicks", storage.url + "/chk-1/sp"], "overlaps the state root of 'clicks'"),
        (["clicks", store_url.rsplit("/", 1)[0]], "overlaps the state root of 'clicks'"),   # contains it
        (["clicks", sp + "/chk-1"], "ends in 'chk-1', which restore_from reads as a checkpoint directory"),
        (["clicks", sp + "/_metadata/"], "ends in '_metadata', which restore_from reads"),
    ]
    for argv, why in cases:
        assert main(["checkpoints", "savepoint", store_url, *argv]) == 2, argv
        assert why in _error(capsys), argv
        assert not sp_loc.exists(sp_loc.path("_metadata"))
    assert main(["checkpoints", "savepoint", store_url, "clicks", sp]) == 0
    capsys.readouterr()
    assert main(["checkpoints", "savepoint", store_url, "clicks", sp, "--checkpoint", "0"]) == 2
    assert f"savepoint {sp!r} already exists" in _error(capsys)


def test_a_live_writer_is_refused_naming_the_state_and_the_way(tmp_path, store_url, capsys):
    storage = _state(tmp_path, store_url)
    sp = store_url + "-savepoints/live"
    lease = StateLease(storage.location, "clicks", application="app-stream", ttl=60)
    lease.acquire()
    assert main(["checkpoints", "savepoint", store_url, "clicks", sp]) == 2
    err = _error(capsys)
    assert "not taking a savepoint of state 'clicks'" in err and "app-stream" in err and "ks.savepoint(url)" in err
    assert not open_location(sp).exists(open_location(sp).root)
    lease.release()
    assert main(["checkpoints", "savepoint", store_url, "clicks", sp]) == 0


def test_the_default_checkpoint_dir_is_the_embedded_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    default = str(tmp_path / "xdg" / "spark-steward" / "checkpoints")
    assert main(["checkpoints", "savepoint", "clicks", str(tmp_path / "sp")]) == 2
    assert "(the default checkpoint dir: none was given)" in _error(capsys)
    _state(tmp_path, default)
    assert main(["checkpoints", "savepoint", "clicks", str(tmp_path / "sp")]) == 0
    assert capsys.readouterr().out == f"file://{tmp_path}/sp/_metadata\n"
    assert main(["checkpoints", "savepoint", "clicks", default + "/sp2"]) == 2
    assert "overlaps its checkpoint dir" in _error(capsys)


def test_the_storage_options_reach_the_copy(s3, tmp_path, monkeypatch, capsys):
    import s3fs
    from sparksteward import storage as storage_module
    from sparksteward.storage import OPTIONS_KEY

    chk = s3.url(f"chk-{os.getpid()}-conf")
    _state(tmp_path, chk)
    for k in [k for k in os.environ if k.startswith("AWS_ENDPOINT_URL")]:
        monkeypatch.delenv(k)
    monkeypatch.setattr(storage_module, "_DEFAULT_OPTIONS", {})   # main() sets them for this process
    s3fs.S3FileSystem.clear_instance_cache()   # none made with the endpoint of the environment
    sp = s3.url(f"sp-{os.getpid()}-conf")
    assert main(["checkpoints", "savepoint", chk, "clicks", sp, "--conf",
                 f"{OPTIONS_KEY}={s3.storage_options()}"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out == f"{sp}/_metadata\n"
    assert s3.filesystem().exists(f"{s3.bucket}/sp-{os.getpid()}-conf/_metadata")


def test_write_savepoint_reports_every_file_in_order(tmp_path, store_url, monkeypatch):
    from sparksteward.checkpoint import duplicate
    from sparksteward.checkpoint.restore import write_savepoint

    storage = _state(tmp_path, store_url)
    meta = storage.read_metadata(1)
    monkeypatch.setattr(duplicate, "_S3_BATCH", 2)   # server-side copies report per batch
    calls: list[tuple[int, int]] = []
    write_savepoint(storage, meta, store_url + "-savepoints/p", progress=lambda done, total: calls.append((done, total)))
    files = len({f.path for f in meta.files()})
    assert calls[-1] == (files, files) and all(t == files for _, t in calls)
    assert [d for d, _ in calls] == sorted({d for d, _ in calls})   # strictly increasing
    assert len(calls) == (files if storage.location.is_local else -(-files // 2))
