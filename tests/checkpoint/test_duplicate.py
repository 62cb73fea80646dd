"""Fast duplication: S3 CopyObject and local hard links move no bytes through the process; any other
pair streams, and the count says so."""

from __future__ import annotations

import os

import pytest
from sparksteward.checkpoint.duplicate import Duplicator, can_fast_duplicate
from sparksteward.errors import CheckpointNotFoundError
from sparksteward.storage import open_location

PAYLOAD = os.urandom(3 << 20)


def test_local_to_local_links_and_moves_no_bytes(tmp_path):
    src = tmp_path / "a" / "f.sst"
    src.parent.mkdir()
    src.write_bytes(PAYLOAD)
    dst = tmp_path / "b" / "f.sst"
    assert can_fast_duplicate(str(src), str(dst))
    d = Duplicator()
    d.duplicate([(str(src), str(dst)), (f"file://{src}", f"file://{tmp_path / 'c' / 'g'}")])
    assert d.bytes_streamed == 0 and d.stats.linked == 2
    assert dst.read_bytes() == PAYLOAD and os.path.samefile(src, dst)
    d.duplicate([(str(src), str(dst))])  # again: idempotent
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        d.duplicate([(str(tmp_path / "nope"), str(tmp_path / "x"))])


def test_s3_to_s3_is_server_side_and_local_to_s3_streams(s3, tmp_path):
    fs = s3.filesystem()
    src, dst = s3.url("a", "f.sst"), s3.url("b", "f.sst")
    fs.pipe_file(src.removeprefix("s3://"), PAYLOAD)
    assert can_fast_duplicate(src, dst)
    d = Duplicator()
    d.duplicate([(src, dst)])
    assert d.bytes_streamed == 0 and d.stats.server_side == 1
    assert open_location(dst).read_bytes(dst.removeprefix("s3://")) == PAYLOAD
    local = tmp_path / "l.sst"
    local.write_bytes(PAYLOAD)
    assert not can_fast_duplicate(str(local), dst)
    d.duplicate([(str(local), s3.url("c", "f.sst")), (dst, str(tmp_path / "back.sst"))])
    assert d.bytes_streamed == 2 * len(PAYLOAD) and d.stats.streamed == 2
    assert (tmp_path / "back.sst").read_bytes() == PAYLOAD
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        d.duplicate([(s3.url("missing"), s3.url("x"))])
