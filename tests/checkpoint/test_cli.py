"""`steward checkpoints ls|show|gc` on file:// and moto S3 checkpoint dirs."""

from __future__ import annotations

import orjson

from sparksteward.checkpoint.coordinator import CheckpointCoordinator
from sparksteward.checkpoint.storage import CheckpointStorage
from sparksteward.cli import main

from tests.helpers.checkpoint import BATCHES, M, P, run_batch


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
