"""``steward://`` URLs: a blob that Spark fetches (``addJar``, ``addFile``, ``spark.jars``) through the
shim's read-only Hadoop FileSystem (decision 0009).

Form::

    steward://<scope>/<job>/<key>/<file name>

- ``scope`` says whose blob it is. ``app-<16 hex>`` is an application's scope: the first 8 bytes of
  ``HMAC-SHA256(secret, "sparksteward url scope")``, so an agent recognizes URLs of its own
  application without the secret ever appearing in a URL, and refuses the URL of another application
  (another secret) with :class:`~sparksteward.errors.BlobScopeError`. ``cluster-<hex>`` names a
  cluster id (hex of its UTF-8): blobs put into the HA store ahead of time (``steward blobs put``),
  readable by every application of that cluster id.
- ``job`` is the job the blob belongs to (its end deletes the blob): the job id itself when it is
  made of letters, digits, ``.``, ``_`` and ``-`` (starting with a letter or digit), else ``~`` and the
  hex of its UTF-8; ``~`` alone means no job.
- ``key`` is the blob key (``p-<32 hex>``): the content hash every copy is verified against.
- ``file name`` is the name Spark gives the fetched file (and the jar on the class path); one plain
  path component.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass

from sparksteward.blob.key import BlobKey
from sparksteward.errors import BlobScopeError, InvalidIdError
from sparksteward.ids import validate_id, validate_job_id

__all__ = ["SCHEME", "BlobUrl", "app_scope", "cluster_scope"]

SCHEME = "steward"
_SCOPE_LABEL = b"sparksteward url scope\0"
_PLAIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SCOPE = re.compile(r"^(app-[0-9a-f]{16}|cluster-(?:[0-9a-f]{2})+)$")
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+-]{0,254}$")
_MAX_URL = 4096


def app_scope(secret: str) -> str:
    """The URL scope of the application whose secret is ``secret``."""
    return "app-" + hmac.new(secret.encode(), _SCOPE_LABEL, hashlib.sha256).hexdigest()[:16]


def cluster_scope(cluster_id: str) -> str:
    """The URL scope of blobs put ahead of time into the HA store of ``cluster_id``."""
    return "cluster-" + validate_id(cluster_id, "cluster id").encode().hex()


def _job_segment(job_id: str | None) -> str:
    if job_id is None:
        return "~"
    validate_job_id(job_id)
    return job_id if _PLAIN.match(job_id) else "~" + job_id.encode().hex()


def _job_from_segment(seg: str, url: str) -> str | None:
    if seg == "~":
        return None
    if _PLAIN.match(seg):
        return validate_job_id(seg)
    if seg.startswith("~"):
        try:
            return validate_job_id(bytes.fromhex(seg[1:]).decode())
        except (ValueError, UnicodeDecodeError):
            pass
    raise InvalidIdError(f"steward URL {url!r}: the job segment {seg!r} is not a job id, '~' or '~<hex>'")


def validate_file_name(name: object) -> str:
    """Return ``name`` if it can be the file name of a ``steward://`` URL (one plain path component)."""
    if not isinstance(name, str) or not _NAME.match(name) or name in (".", ".."):
        raise InvalidIdError(f"file name {name!r} cannot go into a steward:// URL: use 1 to 255 letters, digits, "
                             "'.', '_', '+' or '-', not starting with '.', '+' or '-' (rename the file)")
    return name


@dataclass(frozen=True, slots=True)
class BlobUrl:
    """One ``steward://`` URL, parsed and validated. ``str()`` gives the URL."""

    scope: str
    job_id: str | None
    key: BlobKey
    name: str

    def __post_init__(self) -> None:
        if not isinstance(self.scope, str) or not _SCOPE.match(self.scope):
            raise InvalidIdError(f"steward URL scope {self.scope!r} is not valid: expected 'app-<16 hex>' or "
                                 "'cluster-<hex>'")
        if not isinstance(self.key, BlobKey):
            raise InvalidIdError(f"steward URL key {self.key!r} is not a BlobKey")
        if self.job_id is not None:
            validate_job_id(self.job_id)
        validate_file_name(self.name)

    def __str__(self) -> str:
        return f"{SCHEME}://{self.scope}/{_job_segment(self.job_id)}/{self.key}/{self.name}"

    @classmethod
    def parse(cls, text: object) -> BlobUrl:
        """Parse a URL; anything malformed raises :class:`InvalidIdError` naming it and the expected form."""
        form = "steward://<scope>/<job>/<key>/<file name>"
        if not isinstance(text, str) or len(text) > _MAX_URL or not text.startswith(f"{SCHEME}://"):
            raise InvalidIdError(f"{text!r} is not a steward URL: expected {form}")
        parts = text[len(SCHEME) + 3:].split("/")
        if len(parts) != 4:
            raise InvalidIdError(f"steward URL {text!r} does not have the form {form}")
        scope, job, key, name = parts
        return cls(scope, _job_from_segment(job, text), BlobKey.parse(key), name)

    @property
    def cluster_id(self) -> str | None:
        """The cluster id of a cluster-scoped URL, else None."""
        if not self.scope.startswith("cluster-"):
            return None
        return bytes.fromhex(self.scope[len("cluster-"):]).decode("utf-8", "replace")

    def check_scope(self, secret: str, cluster_id: str | None) -> None:
        """Raise :class:`BlobScopeError` unless this URL belongs to this application (``secret``) or
        to its cluster (``cluster_id``; None: the application has no HA store)."""
        if self.cluster_id is not None:
            if cluster_id is None:
                raise BlobScopeError(
                    f"{self} names a blob put ahead of time into the HA store of cluster {self.cluster_id!r}, "
                    f"but this application has no HA store: set spark.steward.ha.path (and "
                    f"spark.steward.cluster-id={self.cluster_id}) to the store `steward blobs put` used")
            if self.cluster_id != cluster_id:
                raise BlobScopeError(
                    f"{self} names a blob of cluster {self.cluster_id!r}, but this application uses cluster id "
                    f"{cluster_id!r}: set spark.steward.cluster-id={self.cluster_id}, or put the file again with "
                    f"`steward blobs put --cluster-id {cluster_id}`")
            return
        mine = app_scope(secret)
        if not hmac.compare_digest(self.scope, mine):
            raise BlobScopeError(
                f"{self} belongs to another application (scope {self.scope}; this application's is {mine}): "
                "steward:// URLs of st.add_jar/st.add_file work only in the application that made them. "
                "Add the file again in this application, or use `steward blobs put` for a URL that every "
                "application of a cluster can read")
