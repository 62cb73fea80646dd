"""What a :class:`~sparksteward.keyed_state.KeyedState` tells about its batches beside running them: its
checkpoints (``info``), the report of each checkpoint it committed and the input figures a streaming
query's progress can carry."""

from __future__ import annotations

from typing import Any

from sparksteward.checkpoint.lifecycle_messages import CheckReply, InfoRequest

__all__ = ["KeyedStateFigures"]


class KeyedStateFigures:
    """The figures of a keyed state's batches (a base of :class:`~sparksteward.keyed_state.KeyedState`)."""

    name: str
    key: str
    parallelism: int
    max_parallelism: int
    _registered: bool
    _reports: dict[int, dict[str, Any]]   # checkpoint id -> its report, the latest ones

    def _key_type_of(self, df: Any) -> str:
        raise NotImplementedError

    def _check(self) -> CheckReply:
        raise NotImplementedError

    def _ask(self, request: Any) -> Any:
        raise NotImplementedError

    def info(self) -> dict[str, Any]:
        """Last completed, retained and pending checkpoints, the latest completed ``_metadata``, the
        parallelism, and ``checkpoints``: per checkpoint acked in this application, the files and bytes
        its subtasks uploaded and reused, and each subtask's ``restores`` (old subtasks and files read,
        bytes downloaded). ``backlog``: what unaligned batches deferred and no batch processed yet, in
        the latest completed checkpoint (``checkpoint_id``, ``bytes``, ``rows`` when acked in this
        application, the ``subtasks`` that hold some, and ``growth``: for how many checkpoints in a row
        it grew; from 3 on, each batch warns); :meth:`drain` processes it. ``drains``: the ids drains
        took. ``report``: the latest checkpoint's figures (:meth:`report`). ``applied``: whether a batch
        ran in this application; before one did, what opening it will find with a ``note``."""
        checked = None if self._registered else self._check()
        if checked is None or checked.registered:   # applied here, by this object or another
            return {**self._ask(InfoRequest(self.name)).to_wire(), "applied": True}
        found = checked.to_wire()
        last = found.get("last_completed")
        return {**found, "applied": False, "parallelism": self.parallelism, "max_parallelism": self.max_parallelism,
                "pending": [], "checkpoints": [],
                "note": f"keyed state {self.name!r} has not been applied in this application yet; "
                        + (f"its next batch goes on from checkpoint {last} in {found['checkpoint_dir']}"
                           if last is not None else
                           f"restore_from: {found['restore_from']}" if found.get("restore_from") else
                           f"it has no checkpoint in {found['checkpoint_dir']}: its first batch starts empty")}

    def report(self, batch_id: int | None = None, *, checkpoint_id: int | None = None) -> dict[str, Any] | None:
        """The figures of a checkpoint this object committed (the latest 100 are kept): rows in and
        out, keys touched, entries, state bytes (local and checkpointed), bytes uploaded and reused,
        objects written, sync/async/commit/whole durations, restore and rescale time (see
        :mod:`sparksteward.checkpoint.coordination.report`, and docs/state.md, "Metrics").

        Parameters
        ----------
        batch_id : int, optional
            The streaming batch (``progress["batchId"]`` in a ``StreamingQueryListener``): its
            checkpoint completed before Spark reports the batch's progress.
        checkpoint_id : int, optional
            The checkpoint instead. With neither: the latest.

        Returns
        -------
        dict or None
            The report, or None when this object committed no such checkpoint (another process did,
            or it is older than the kept ones; ``info()["report"]`` has the driver agent's latest).
        """
        if checkpoint_id is not None:
            return self._reports.get(checkpoint_id)
        if batch_id is not None:
            return next((r for r in reversed(self._reports.values()) if r.get("batch_id") == batch_id), None)
        return self._reports[max(self._reports)] if self._reports else None

    def observe(self, df: Any, name: str | None = None) -> Any:
        """``df.observe`` with this state's input figures, for the query's progress.

        Call it on the streaming DataFrame before ``writeStream.foreachBatch(ks.process(...))``: each
        batch's ``query.lastProgress["observedMetrics"][name]`` (and a ``StreamingQueryListener``'s
        ``event.progress.observedMetrics``) then holds ``rows_in`` (the batch's input rows) and
        ``keys_approx`` (its distinct keys, HyperLogLog: observed metrics allow no exact distinct
        count). Figures known only after the commit (rows out, bytes, durations) cannot enter the
        progress from PySpark: read them with :meth:`report` by the progress's ``batchId``. The input
        is counted as often as the batch's DataFrame is computed (once a batch with ``process``).

        Parameters
        ----------
        df : DataFrame
            The streaming DataFrame the state's batches come from; it must have the key column.
        name : str, optional
            The observation's name; default ``steward.<state name>``.
        """
        from pyspark.sql import functions as F

        self._key_type_of(df)
        return df.observe(name or f"steward.{self.name}", F.count(F.lit(1)).alias("rows_in"),
                          F.approx_count_distinct(F.col(self.key)).alias("keys_approx"))
