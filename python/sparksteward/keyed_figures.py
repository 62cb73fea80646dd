"""What a :class:`~sparksteward.keyed_state.KeyedState` tells about its batches beside running them: the
report of each checkpoint it committed and the input figures a streaming query's progress can carry."""

from __future__ import annotations

from typing import Any

__all__ = ["KeyedStateFigures"]


class KeyedStateFigures:
    """The figures of a keyed state's batches (a base of :class:`~sparksteward.keyed_state.KeyedState`)."""

    name: str
    key: str
    _reports: dict[int, dict[str, Any]]   # checkpoint id -> its report, the latest ones

    def _key_type_of(self, df: Any) -> str:
        raise NotImplementedError

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
