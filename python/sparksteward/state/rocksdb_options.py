"""The RocksDB options of a keyed-state DB: how it is created (:func:`db_options`), how it is reopened
and written (:func:`reopen_options`, :func:`write_options`). rocksdict cannot set every option
RocksDB has, so the reopen options are read from a patched OPTIONS file and tried once per process."""

from __future__ import annotations

import functools
import logging
import os
import re
import tempfile

import rocksdict

__all__ = ["db_options", "open_db", "reopen_options", "write_options"]

log = logging.getLogger("sparksteward.state.rocksdb_options")


def db_options(*, create: bool) -> rocksdict.Options:
    """The options a keyed-state DB is created with (raw byte keys; create only when new)."""
    opts = rocksdict.Options(raw_mode=True)
    opts.create_if_missing(create)
    return opts


def open_db(path: str | os.PathLike[str], opts: rocksdict.Options, *, read_only: bool = False,
            auto_compactions: bool = True) -> rocksdict.Rdict:
    """Open the keyed-state DB at ``path`` with ``opts``. The column family's options (here whether
    RocksDB compacts on its own) are passed apart: rocksdict applies those set on ``opts`` only to a
    DB it creates, never to one it opens, so ``set_disable_auto_compactions`` on ``opts`` did nothing
    to a DB that existed. (A bloom filter set the same way cut a subtask's cold multi-get by 9% and its
    state work by 3% in ``bench_state_ceiling.py``'s loop, for SSTs 9% larger: not kept.)"""
    column = rocksdict.Options(raw_mode=True)
    if not auto_compactions:
        column.set_disable_auto_compactions(True)
    if read_only:
        return rocksdict.Rdict(str(path), opts, column_families={"default": column},
                               access_type=rocksdict.AccessType.read_only())
    return rocksdict.Rdict(str(path), opts, column_families={"default": column})


def reopen_options() -> rocksdict.Options:
    """The options a DB is written with after its creation: :func:`db_options` plus
    ``avoid_flush_during_recovery``, so the WAL a snapshot kept is replayed, not flushed into a new
    SST (with fsyncs) at every open, and ``wal_compression=kZSTD``, so the WAL a checkpoint uploads is
    compressed (any open reads it back; the compression is recorded in the WAL itself).

    rocksdict has no setter for either, so they are read through ``Options.load_latest`` from an
    OPTIONS file RocksDB wrote for :func:`db_options`, with those lines changed, and tried on a scratch
    DB (built once per process). If ZSTD fails, the WAL stays uncompressed; if the rest fails, the DB
    is reopened with :func:`db_options`: correct, only slower.
    """
    opts = _load_reopen_options()
    return opts if opts is not None else db_options(create=False)


@functools.cache
def _load_reopen_options() -> rocksdict.Options | None:
    for compression in ("kZSTD", None):
        opts = _patched_options(compression)
        if opts is not None:
            return opts
    return None


def _patched_options(wal_compression: str | None) -> rocksdict.Options | None:
    try:
        with tempfile.TemporaryDirectory(prefix="steward-options-") as tmp:
            db = rocksdict.Rdict(os.path.join(tmp, "db"), db_options(create=True))
            db.close()
            del db
            written = sorted((n for n in os.listdir(os.path.join(tmp, "db")) if n.startswith("OPTIONS-")),
                             key=lambda n: int(n.split("-", 1)[1]))
            with open(os.path.join(tmp, "db", written[-1]), encoding="utf-8") as fh:
                text = fh.read()
            patched, n = re.subn(r"(?m)^(\s*avoid_flush_during_recovery=)false$", r"\1true", text)
            if n != 1:
                raise ValueError("no avoid_flush_during_recovery=false line in RocksDB's OPTIONS file")
            if wal_compression is not None:
                patched, n = re.subn(r"(?m)^(\s*wal_compression=)\w+$", rf"\g<1>{wal_compression}", patched)
                if n != 1:
                    raise ValueError("no wal_compression line in RocksDB's OPTIONS file")
            os.mkdir(os.path.join(tmp, "options"))
            with open(os.path.join(tmp, "options", "OPTIONS-000001"), "w", encoding="utf-8") as fh:
                fh.write(patched)
            opts = rocksdict.Options.load_latest(os.path.join(tmp, "options"))[0]
            opts.create_if_missing(False)
            # try them: write through a reopen, then read back through a plain open
            db = rocksdict.Rdict(os.path.join(tmp, "db"), opts)
            db.put(b"steward-probe", b"x" * 100)
            db.cancel_all_background(True)
            del db
            db = rocksdict.Rdict(os.path.join(tmp, "db"), db_options(create=False))
            ok = db.get(b"steward-probe") == b"x" * 100
            db.close()
            del db
            if not ok:
                raise ValueError("a value written with them did not read back")
        return opts
    except Exception as exc:  # noqa: BLE001 - rocksdict raises a bare Exception
        log.warning("cannot use RocksDB options avoid_flush_during_recovery%s (%s)",
                    f" and wal_compression={wal_compression}" if wal_compression else "", exc)
        return None


def write_options() -> rocksdict.WriteOptions:
    return rocksdict.WriteOptions()  # WAL on, never synced (sync=False is the default)
