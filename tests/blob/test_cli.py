"""`steward blobs ls|gc` on a real HA storage path and JobResultStore, and `blobs put`'s progress line on
file:// and moto S3."""

from __future__ import annotations

import os
import sys

from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.store import FileSystemBlobStore
from sparksteward.cli import main
from sparksteward.hashing import hash_file
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.service import JobService

from tests.helpers.terminal import FakeTerminal


def test_ls_and_gc(tmp_path, capsys):
    ha = FileSystemBlobStore(str(tmp_path / "ha"))
    src = tmp_path / "lib.whl"
    src.write_bytes(b"wheel" * 1000)
    key = BlobKey(BlobType.PERMANENT, hash_file(src))
    for job in ("finished-job", "running-job", None):
        ha.put(job, key, src)
    svc = JobService(FileSystemJobResultStore(str(tmp_path / "jrs")), cluster_id="default")
    svc.begin("finished-job")
    svc.finish("finished-job", "SUCCEEDED")
    args = ["--path", str(tmp_path / "ha")]

    assert main(["blobs", "ls", *args]) == 0
    out = capsys.readouterr().out
    assert "3 blob(s), 14.6 KiB" in out and "finished-job" in out and "@none" in out and "permanent" in out

    assert main(["blobs", "gc", *args, "--jrs-path", str(tmp_path / "jrs"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would delete finished-job: 1 blob(s) (job SUCCEEDED, clean)" in out and ha.jobs()

    assert main(["blobs", "gc", *args, "--jrs-path", str(tmp_path / "jrs")]) == 0
    out = capsys.readouterr().out
    assert "deleted finished-job" in out and "kept 2" in out
    assert sorted(ha.jobs(), key=str) == sorted([None, "running-job"], key=str)


def test_put_shows_the_bytes_uploaded_on_a_terminal(tmp_path, ha, capsys, monkeypatch):
    jar = tmp_path / "big.jar"
    jar.write_bytes(os.urandom(10 << 20))
    args = ["--ha", ha.url, "--cluster-id", "c1"]
    assert main(["blobs", "put", str(jar), *args, "--job", "piped"]) == 0
    assert "uploading" not in capsys.readouterr().err   # no progress line off a terminal
    tty = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["blobs", "put", str(jar), *args]) == 0
    line, said, rest = tty.getvalue().split("\n")
    # S3: the size once known, then what the PUT sent (a multipart upload reports per part);
    # a local store: the stored blob only
    assert line == ("\ruploading big.jar: 0.0/10.0 MB" if not ha.base.is_local else "") + \
        "\ruploading big.jar: 10.0/10.0 MB", line
    assert said.startswith("uploaded big.jar (10.0 MiB)") and rest == ""
    before = len(tty.getvalue())
    assert main(["blobs", "put", str(jar), *args]) == 0   # already stored: nothing goes, no line
    again = tty.getvalue()[before:]
    assert "is already stored" in again and "uploading" not in again
