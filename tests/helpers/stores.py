"""Stores that do not honour conditional writes, for the probe of ``sparksteward.storage`` (issue 35
item 6). They are real fsspec file systems; the store is not the thing under test, the probe is.

- :class:`IgnoringS3`: an S3-compatible store that silently ignores ``If-None-Match`` and ``If-Match``
  (moto behind an s3fs client that drops both headers from every ``PutObject``).
- :class:`NoModeMemory`: an fsspec backend whose ``pipe_file`` takes no ``mode=`` (nor any other
  option), with ETags like an object store, so that everything but the conditions works.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import s3fs
from fsspec.implementations.memory import MemoryFileSystem
from sparksteward.storage import Location
from sparksteward.testing.s3 import LocalS3


class IgnoringS3(s3fs.S3FileSystem):
    """An S3-compatible store that ignores the conditions of a PUT (as some older or partial S3
    implementations do): the headers never reach moto."""

    async def _call_s3(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "put_object":
            kwargs.pop("IfNoneMatch", None)
            kwargs.pop("IfMatch", None)
        return await super()._call_s3(method, *args, **kwargs)


def ignoring_s3(s3: LocalS3, *parts: str) -> Location:
    """The location ``s3://<bucket>/<parts>`` on moto, through :class:`IgnoringS3`."""
    fs = IgnoringS3(client_kwargs={"endpoint_url": s3.endpoint}, key="testing", secret="testing",
                    skip_instance_cache=True)
    return Location(fs, "/".join((s3.bucket, *parts)), s3.url(*parts))


class NoModeMemory(MemoryFileSystem):
    """An in-memory fsspec backend without ``mode=`` on ``pipe_file``, which reports ETags."""

    protocol = ("nomode",)
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]

    def pipe_file(self, path: str, value: bytes) -> None:  # type: ignore[override]
        super().pipe_file(path, value)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        out = super().info(path, **kwargs)
        if out.get("type") == "file":
            out["ETag"] = f'"{hashlib.md5(self.cat_file(path)).hexdigest()}"'
        return out


def no_mode_memory(*parts: str) -> Location:
    """The location ``nomode://<parts>`` on :class:`NoModeMemory`."""
    return Location(NoModeMemory(), "/" + "/".join(parts), "nomode://" + "/".join(parts))
