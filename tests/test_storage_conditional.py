"""The probe of a store's conditional writes (issue 35 item 6): a store that honours ``If-None-Match``
and ``If-Match`` (moto) passes; one that ignores them, or an fsspec backend without ``mode=``, is found
out; a store (an object store's bucket) is probed once per process, and the probe leaves nothing behind."""

from __future__ import annotations

import os

from sparksteward.storage import PROBE_PREFIX, open_location, probe_conditional_writes

from tests.helpers.s3 import new_bucket
from tests.helpers.stores import ignoring_s3, no_mode_memory


def _probes(reqs):
    return [r for r in reqs if os.path.basename(r.key).startswith(PROBE_PREFIX)]


def test_moto_s3_honours_conditional_writes(s3):
    s3 = new_bucket(s3)
    loc = open_location(s3.url("honest"))
    got = probe_conditional_writes(loc)
    assert got.honoured and got.create and got.replace
    assert got.store == f"s3://{s3.bucket}" and s3.url("honest") in got.detail and "If-None-Match" in got.detail
    assert loc.listdir() == []   # the probe object is gone
    assert got.to_json() == {"store": f"s3://{s3.bucket}", "honoured": True, "create": True, "replace": True,
                             "detail": got.detail}


def test_an_s3_store_that_ignores_the_conditions_is_found_out(s3):
    loc = ignoring_s3(s3, "liar")
    got = probe_conditional_writes(loc)
    assert not got.honoured and not got.create and not got.replace
    assert "If-None-Match" in got.detail and "If-Match" in got.detail
    assert loc.listdir() == []


def test_an_fsspec_backend_without_mode_is_found_out():
    loc = no_mode_memory("nomode-probe")
    got = probe_conditional_writes(loc)
    assert not got.honoured and not got.create and not got.replace
    assert "NoModeMemory" in got.detail and "mode=" in got.detail
    assert not [p for p in type(loc.fs).store if PROBE_PREFIX in p]   # the probe object is gone


def test_a_local_store_is_honoured_without_requests(tmp_path):
    got = probe_conditional_writes(open_location(str(tmp_path / "local")))
    assert got.honoured and "os.link" in got.detail
    assert not (tmp_path / "local").exists()


def test_the_probe_runs_once_per_store(s3):
    s3 = new_bucket(s3)   # a store this process has not probed yet
    mark = s3.mark()
    first = probe_conditional_writes(open_location(s3.url("once", "a")))
    reqs = _probes(s3.requests_since(mark))
    assert [r.status for r in reqs if r.op == "PutObject"] == [200, 412, 412, 200]   # 2 creates, 2 replaces
    assert all(r.key.startswith("once/a/") for r in reqs)   # under the location it was asked about
    mark = s3.mark()
    assert probe_conditional_writes(open_location(s3.url("once", "a"))) is first   # the same root again
    assert probe_conditional_writes(open_location(s3.url("elsewhere"))) is first   # the same bucket
    assert s3.requests_since(mark) == []
    bucket = new_bucket(s3)                                                        # another store
    mark = bucket.mark()
    other = probe_conditional_writes(open_location(bucket.url("b")))
    assert other.store == f"s3://{bucket.bucket}" and other.honoured and _probes(bucket.requests_since(mark))
