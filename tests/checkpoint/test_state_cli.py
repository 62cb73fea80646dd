"""``steward state show|read|diff|bootstrap`` (issue 39) over checkpoints written by real RocksDB
subtasks (tests/checkpoint/test_changes.py's rounds) and savepoints it bootstraps from files: what
it prints equals what the readers return, and bad input is one line naming it, exit status 2."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sparksteward.checkpoint.changes import read_changes
from sparksteward.checkpoint.reader import read_variable
from sparksteward.checkpoint.storage import CheckpointStorage, open_checkpoint
from sparksteward.cli import main
from sparksteward.state.declared import value_state
from sparksteward.state_cli import bootstrap_files

from tests.checkpoint.test_changes import T0, _round


@pytest.fixture
def state(tmp_path):
    storage = CheckpointStorage.open(f"file://{tmp_path}/chk", "feed")
    rnd = random.Random(7)
    metas, base = [], None
    for cid in range(3):
        base = _round(storage, base, cid, 2, T0 + 1000 * cid, rnd, tmp_path)
        metas.append(base)
    return storage, metas, f"file://{tmp_path}/chk"


def _json(capsys, *argv):
    assert main(list(argv)) == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_show_read_and_diff_print_what_the_readers_return(state, capsys):
    storage, metas, url = state
    shown = _json(capsys, "state", "show", url, "--state", "feed", "--json")
    assert [(r["checkpoint"], r["parallelism"], r["max_parallelism"]) for r in shown] == [(0, 2, 32), (1, 2, 32), (2, 2, 32)]
    assert shown[0]["variables"] == "l:list,m:map,v:value"
    rows = _json(capsys, "state", "read", url, "--state", "feed", "--checkpoint", "1", "--variable", "m", "--json")
    want = read_variable(storage, metas[1], "m", now_ms=T0 + 1000).to_pylist()
    assert sorted(map(str, rows)) == sorted(map(str, want))
    diff = _json(capsys, "state", "diff", url, "--state", "feed", "--from", "0", "--variable", "v", "--json")
    assert sorted(map(str, diff)) == sorted(map(str, read_changes(storage, metas[0], metas[2], "v").to_pylist()))
    assert diff and {r["change_type"] for r in diff} <= {"upsert", "delete"} and {r["checkpoint_id"] for r in diff} == {2}
    assert main(["state", "read", url, "--state", "feed", "--variable", "m", "--limit", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["KEY", "MAP_KEY", "VALUE"] and len(out) == 5   # header, rule, three rows


def test_bootstrap_writes_a_savepoint_from_files_that_reads_back(tmp_path, capsys):
    pq.write_table(pa.table({"key": [f"u{i}" for i in range(1000)], "value": list(range(1000))}), tmp_path / "c.parquet")
    (tmp_path / "e.csv").write_text("key,value\n" + "".join(f"u{i % 3},{i}\n" for i in range(9)))
    (tmp_path / "m.json").write_text("".join(json.dumps({"key": "u1", "map_key": f"k{i}", "value": i}) + "\n"
                                             for i in range(4)))
    url = f"file://{tmp_path}/sp/boot-1"
    assert main(["state", "bootstrap", url, "--state", "boot", "--declare", "count=value bigint",
                 "--declare", "events=list int", "--declare", "seen=map string -> bigint", "--ttl", "count=1h",
                 "--data", f"count={tmp_path}/c.parquet", "--data", f"events={tmp_path}/e.csv",
                 "--data", f"seen={tmp_path}/m.json", "--parallelism", "3", "--max-parallelism", "16"]) == 0
    assert capsys.readouterr().out.strip() == f"{tmp_path}/sp/boot-1/_metadata"
    storage, meta = open_checkpoint(url)
    assert (meta.parallelism, meta.max_parallelism, meta.key_type.value) == (3, 16, "string")
    assert {r["key"]: r["value"] for r in read_variable(storage, meta, "count").to_pylist()} == \
        {f"u{i}": i for i in range(1000)}
    events = _json(capsys, "state", "read", url, "--variable", "events", "--json")
    assert [r["value"] for r in events if r["key"] == "u1"] == [1, 4, 7]   # the file's order
    seen = _json(capsys, "state", "read", url, "--variable", "seen", "--json")
    assert sorted((r["map_key"], r["value"]) for r in seen) == [(f"k{i}", i) for i in range(4)]
    expiry = _json(capsys, "state", "read", url, "--variable", "count", "--expiry", "--json", "--limit", "1")
    assert expiry[0]["expires_ms"] > T0


@pytest.mark.parametrize("argv, message", [
    (["--declare", "count=valu bigint", "--data", "count=DATA"], r"--declare 'count=valu bigint' must be NAME=value TYPE"),
    (["--declare", "count=value bigint", "--data", "count=/nonexistent.parquet"], r"--data count=/nonexistent.parquet: no such file"),
    (["--declare", "count=value bigint", "--data", "other=DATA"], r"data for variable 'other', which is not declared"),
    (["--declare", "count=value bigint", "--data", "count=BAD"], r"column 'value' \(string\) cannot be read as int64"),
    (["--declare", "count=value bigint", "--ttl", "count=soon", "--data", "count=DATA"], r"--ttl count='soon' is not a duration"),
])
def test_bootstrap_refuses_bad_input_in_one_line(tmp_path, capsys, argv, message):
    import re

    pq.write_table(pa.table({"key": ["a"], "value": [1]}), tmp_path / "d.parquet")
    pq.write_table(pa.table({"key": ["a"], "value": ["x"]}), tmp_path / "bad.parquet")
    argv = [a.replace("DATA", str(tmp_path / "d.parquet")).replace("BAD", str(tmp_path / "bad.parquet")) for a in argv]
    target = tmp_path / "sp" / "x"
    assert main(["state", "bootstrap", f"file://{target}", "--state", "s", "--parallelism", "1", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not target.exists() or not os.listdir(target)


def test_the_installed_command_runs(state):
    _, _, url = state
    out = subprocess.run([sys.executable, "-m", "sparksteward", "state", "show", url, "--state", "nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "state 'nope' has no completed checkpoint" in out.stderr and "feed" in out.stderr


@pytest.mark.parametrize("key_type", [pa.int64(), pa.int32(), pa.binary(), pa.string()])
def test_every_key_type_reads_back_through_the_vectorized_value_path(tmp_path, key_type):
    keys = [b"k%d" % i for i in range(300)] if key_type == pa.binary() else \
        [f"k{i}" for i in range(300)] if key_type == pa.string() else [i * 7919 - 1000 for i in range(300)]
    pq.write_table(pa.table({"key": pa.array(keys, key_type), "value": list(range(300))}), tmp_path / "d.parquet")
    url = f"file://{tmp_path}/sp/k"
    bootstrap_files(url, state="k", specs=[value_state("v", "bigint", ttl=3600.0)], files={"v": str(tmp_path / "d.parquet")},
                    parallelism=3, max_parallelism=16)
    storage, meta = open_checkpoint(url)
    got = read_variable(storage, meta, "v", expiry=True)
    assert got.schema.field("key").type == {pa.int32(): pa.int32()}.get(key_type, key_type)
    assert sorted(zip(got.column("key").to_pylist(), got.column("value").to_pylist())) == sorted(zip(keys, range(300)))
    assert got.column("expires_ms").null_count == 0
    assert read_variable(storage, meta, "v", now_ms=2**62).num_rows == 0   # all expired by then


def test_a_command_run_in_process_leaves_the_storage_options_as_they_were(state, capsys):
    """``--conf spark.steward.storage.options`` sets the options of the command's process; run from a
    process that goes on (a test, a notebook), ``main`` puts the ones before back (they pointed later
    tests' S3 clients at another server)."""
    from sparksteward.storage import default_options

    _, _, url = state
    before = default_options()
    assert main(["state", "show", url, "--state", "feed", "--conf",
                 'spark.steward.storage.options={"s3": {"endpoint_url": "http://127.0.0.1:9"}}']) == 0
    assert default_options() == before
