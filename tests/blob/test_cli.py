"""`steward blobs ls|gc` on a real HA storage path and JobResultStore."""

from __future__ import annotations

from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.hashing import hash_file
from sparksteward.blob.store import FileSystemBlobStore
from sparksteward.cli import main
from sparksteward.jobs.fs_store import FileSystemJobResultStore
from sparksteward.jobs.service import JobService


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
