"""Reading what a keyed state stored on moto's S3 (its objects, its ``_metadata``, the requests that
moved object bytes): shared by the restore suites on local[2] and on local-cluster."""

from __future__ import annotations

import orjson

CLUSTER = "rs"
DATA_OPS = ("GetObject", "PutObject", "UploadPart")  # requests whose bodies are object bytes


def root(s3, checkpoint_dir: str, name: str) -> str:
    return s3.url(checkpoint_dir, CLUSTER, name)


def metadata(s3, url: str) -> dict:
    return orjson.loads(s3.filesystem().cat_file(url + "/_metadata"))


def checksums(meta: dict) -> set[str]:
    return {f["checksum"] for s in meta["subtasks"] for f in s["files"]}


def listing(s3, url: str) -> dict[str, int]:
    fs = s3.filesystem()
    return {p: info["size"] for p, info in fs.find(url, detail=True).items()} if fs.exists(url) else {}


def object_bytes(reqs) -> int:
    return sum(r.bytes_in + r.bytes_out for r in reqs if r.op in DATA_OPS and not _is_record(r.key))


def _is_record(key: str) -> bool:
    """A checkpoint record, the writer lease, the begun or the drain record: not object bytes of state files."""
    return key.rsplit("/", 1)[-1] in ("_metadata", "_lease", "_begun", "_drains")


def puts_under(reqs, prefix: str) -> dict[str, int]:
    return {r.key.split("/")[-1]: r.bytes_in for r in reqs if r.op in ("PutObject", "UploadPart")
            and r.key.startswith(prefix)}
