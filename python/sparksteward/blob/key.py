"""Blob keys: the blob type plus the xxh3-128 of the content.

Keys are content-addressed with no random part, so identical content is stored and shipped once and
libraries match by content (FLINK-32212 cannot happen). ``str(key)`` (``p-<32 hex>`` for permanent,
``t-<32 hex>`` for transient) is the file name on disk.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from sparksteward.errors import InvalidIdError

__all__ = ["BlobKey", "BlobType", "TYPES_BY_VALUE"]

_TEXT = re.compile(r"^([pt])-([0-9a-f]{32})$")


class BlobType(str, enum.Enum):
    """PERMANENT blobs are HA-backed and kept for recovery; TRANSIENT ones are re-creatable."""

    PERMANENT = "p"
    TRANSIENT = "t"


#: Each type by its value: a dict lookup, where calling the enum costs a microsecond or two.
TYPES_BY_VALUE = {t.value: t for t in BlobType}


@dataclass(frozen=True, slots=True)
class BlobKey:
    """Type + 16-byte xxh3-128 digest of the content."""

    type: BlobType
    digest: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.type, BlobType):
            object.__setattr__(self, "type", BlobType(self.type))
        if not isinstance(self.digest, bytes) or len(self.digest) != 16:
            raise InvalidIdError(f"blob digest must be 16 bytes, not {self.digest!r}")

    def __str__(self) -> str:
        return f"{self.type.value}-{self.digest.hex()}"

    def __hash__(self) -> int:
        # the digest alone: bytes cache their hash (a generated __hash__ also hashes the enum, in Python)
        return hash(self.digest)

    @classmethod
    def parse(cls, text: object) -> BlobKey:
        """Parse ``p-<32 hex>`` / ``t-<32 hex>``; anything else raises InvalidIdError naming it."""
        m = _TEXT.match(text) if isinstance(text, str) else None
        if not m:
            raise InvalidIdError(f"blob key {text!r} is not valid: expected 'p-' or 't-' and 32 lowercase hex digits")
        return cls(TYPES_BY_VALUE[m.group(1)], bytes.fromhex(m.group(2)))

    def to_bytes(self) -> bytes:
        return self.type.value.encode() + self.digest

    @classmethod
    def from_bytes(cls, data: bytes) -> BlobKey:
        if len(data) != 17 or data[:1] not in (b"p", b"t"):
            raise InvalidIdError(f"blob key bytes {data!r} are not valid")
        return cls(TYPES_BY_VALUE[data[:1].decode()], data[1:])

    @property
    def permanent(self) -> bool:
        return self.type is BlobType.PERMANENT
