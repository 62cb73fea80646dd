"""The begins the exactly-once rules refuse, checked by the
:class:`~sparksteward.checkpoint.coordination.coordinator.CheckpointCoordinator` before a begin changes
anything (its module docstring states the rules):

- **order**: a batch older than the last completed checkpoint (its base is gone);
- **task restarts**: a task may begin only what the driver began in this coordinator's life, and not
  what was aborted since (a straggler of the abandoned attempt);
- **one query per state**: a batch id of another streaming query means other rows, so a state never
  takes a batch of query B for a re-run of query A's batch with the same id (that would lose B's
  rows). The query of a checkpoint is in its ``properties.query`` (and on a pending checkpoint); a
  batch of another query than the latest checkpoint's, or than a pending one's, is refused with the
  way out (its own state, or a savepoint of this one to start from).

Each refusal is a :class:`~sparksteward.errors.CheckpointOrderError` that says how to go on.
"""

from __future__ import annotations

from collections.abc import Iterable

from sparksteward.checkpoint.records import CheckpointMetadata
from sparksteward.errors import CheckpointOrderError

__all__ = ["check_begin", "check_query_owner", "query_of"]


def query_of(meta: CheckpointMetadata) -> str | None:
    """The streaming query that wrote checkpoint ``meta`` (None: not a streaming batch, or unknown)."""
    query = meta.properties.get("query")
    return query if isinstance(query, str) else None


def check_query_owner(state: str, checkpoint_id: int, query: str, latest: CheckpointMetadata | None,
                      pending_queries: Iterable[str | None]) -> None:
    """Refuse batch ``checkpoint_id`` of ``query`` when keyed state ``state`` belongs to another streaming
    query: the one of its ``latest`` completed checkpoint, or of a pending one."""
    owner = query_of(latest) if latest is not None else None
    others = sorted({q for q in pending_queries if q not in (None, query)})
    if owner not in (None, query) or others:
        holder = owner if owner not in (None, query) else others[0]
        where = f"its checkpoint {latest.checkpoint_id}" if latest is not None and owner not in (None, query) \
            else "a pending checkpoint"
        raise CheckpointOrderError(
            f"batch {checkpoint_id} of streaming query {query} cannot use keyed state {state!r}: "
            f"{where} belongs to streaming query {holder}, and one state belongs to one query (a batch "
            f"id of another query means other rows, so taking it for a re-run would lose them). Give this "
            f"query its own state name; to start it from this state's data, take a savepoint "
            f"(ks.savepoint(url)) and open a new state with restore_from=url")


def check_begin(state: str, checkpoint_id: int, *, last: int | None, latest: CheckpointMetadata | None,
                query: str | None, pending_queries: Iterable[str | None], by_task: bool, begun_here: bool,
                aborted: bool) -> None:
    """Refuse to begin ``checkpoint_id`` of keyed state ``state`` (see the module docstring). ``last``
    and ``latest``: its last completed checkpoint and record; ``by_task``: a task asks, not the driver;
    ``begun_here``: the driver began it in this coordinator's life; ``aborted``: it was aborted and is
    not pending again."""
    if query is not None:
        check_query_owner(state, checkpoint_id, query, latest, pending_queries)
    if last is not None and checkpoint_id < last:
        raise CheckpointOrderError(
            f"checkpoint {checkpoint_id} of state {state!r} is older than its last completed "
            f"checkpoint {last}: a batch that old cannot be applied again (its base is gone). Restart "
            f"the query from a Spark checkpoint that is not older than batch {last}")
    if by_task and not begun_here:
        raise CheckpointOrderError(
            f"checkpoint {checkpoint_id} of state {state!r} was not begun by this driver agent "
            f"(it restarted since, or the batch was never applied here): a task cannot start it; apply the "
            f"batch again with checkpoint_id={checkpoint_id}")
    if by_task and aborted:
        raise CheckpointOrderError(
            f"checkpoint {checkpoint_id} of state {state!r} was aborted: a task of the "
            f"abandoned attempt cannot start it again; apply the batch again with "
            f"checkpoint_id={checkpoint_id}")
