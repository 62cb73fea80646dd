"""The BLOB service (FLIP-19): content-addressed, checksummed, ref-counted blobs.

``BlobServer`` runs in the driver agent, ``BlobCache`` in every executor agent, ``BlobClient`` in the
user's driver (``st.blobs``); ``FileSystemBlobStore`` is the HA store on any fsspec URL; ``BlobUrl`` is a
``steward://`` URL that Spark fetches jars and files by (decision 0009).
"""

from sparksteward.blob.broadcast import BroadcastHandle
from sparksteward.blob.cache import BlobCache
from sparksteward.blob.client import BlobClient
from sparksteward.blob.key import BlobKey, BlobType
from sparksteward.blob.server import BlobServer
from sparksteward.blob.store import BlobStore, BlobView, FileSystemBlobStore, VoidBlobStore
from sparksteward.blob.url import BlobUrl

__all__ = ["BlobCache", "BlobClient", "BlobKey", "BlobServer", "BlobStore", "BlobType", "BlobUrl", "BlobView",
           "BroadcastHandle", "FileSystemBlobStore", "VoidBlobStore"]
