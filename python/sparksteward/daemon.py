"""PySpark's worker daemon, with spark-steward's library finder installed first.

``sparksteward.configure()`` sets ``spark.python.daemon.module=sparksteward.daemon`` (unless the user
chose another daemon), so every Python worker forked from it can import libraries added with
``Steward.add_library``. The finder sits at the *end* of ``sys.meta_path``: it is consulted only after
a normal import failed, so it costs nothing for imports that already work. The daemon also imports the modules ``h.value``
needs, so forked workers do not each pay for them, and freezes its objects before it forks
(``gc.freeze``, see :func:`sparksteward.worker.settle_heap`).
"""

from __future__ import annotations

import gc

from sparksteward.libraries import install_finder

__all__: list[str] = []


def _executor_libraries() -> tuple[int, list[str]]:
    """The executor agent's ``blob.libraries``: the library list's version and the importable paths."""
    from sparksteward.blob.messages import BlobLibrariesRequest
    from sparksteward.wire.messages import ask
    from sparksteward.worker import executor_connection

    reply = ask(executor_connection(), BlobLibrariesRequest())
    return reply.version, list(reply.paths or [])


if __name__ == "__main__":
    install_finder(_executor_libraries)
    # Workers fork from this process: load what h.value needs once, not in every new worker.
    from pyspark.daemon import manager

    import sparksteward.blob.broadcast
    import sparksteward.blob.payload
    import sparksteward.worker  # noqa: F401

    # the objects loaded so far are never walked by a worker's collections, nor copied by them
    # (sparksteward.worker.settle_heap)
    gc.freeze()
    manager()
