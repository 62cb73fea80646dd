"""The holder of one subtask's declared state variables at one batch (decision 0017):
:class:`TypedStates` hands out each variable's typed view by name and kind, and counts the batch's
list appends."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

from sparksteward.errors import StateError
from sparksteward.state.declared import variables_of
from sparksteward.state.typed.base import TypedView
from sparksteward.state.typed.list import TypedList
from sparksteward.state.typed.map import TypedMap
from sparksteward.state.typed.value import TypedValue
from sparksteward.state.views import StateDB

__all__ = ["TypedStates"]


class TypedStates:
    """The declared variables of one subtask at one batch: ``record`` is the state's declarations
    (``properties.states``), ``now_ms`` the batch's processing time, ``batch`` its checkpoint id,
    ``watermark_ms`` its event-time watermark (None: none yet) and ``event_time`` whether the state has
    an event-time column (decision 0028)."""

    def __init__(self, backend: StateDB, record: Mapping[str, Any] | None, now_ms: int, batch: int,
                 watermark_ms: int | None = None, *, event_time: bool = False) -> None:
        self.backend = backend
        self.variables = variables_of(record)
        self.now_ms = int(now_ms)
        self.watermark_ms = None if watermark_ms is None else int(watermark_ms)
        self.event_time = event_time or watermark_ms is not None
        self.batch = int(batch)
        if not 0 <= self.batch < 1 << 31:
            raise StateError(f"batch {batch} is out of range for list state sequences")
        self._appends = 0
        self._views: dict[str, TypedView] = {}

    def next_seq(self, n: int = 1) -> int:
        """The first of ``n`` fresh list sequence numbers of this batch."""
        first = self._appends
        self._appends += n
        if self._appends >= 1 << 32:
            raise StateError(f"more than 2**32 list appends in one batch of one subtask (batch {self.batch})")
        return (self.batch << 32) | first

    def _view(self, name: str, kind: str) -> Any:
        got = self._views.get(name)
        if got is None:
            var = self.variables.get(name)
            if var is None:
                known = ", ".join(f"{n} ({v.spec.kind})" for n, v in sorted(self.variables.items())) or "none"
                raise StateError(f"state variable {name!r} is not declared; declared: {known}. Declare it with "
                                 f"states=[...] when opening the keyed state")
            cls: type[TypedView] = {"value": TypedValue, "list": TypedList, "map": TypedMap}[var.spec.kind]
            got = self._views[name] = cls(self, var)
        if got.var.spec.kind != kind:
            raise StateError(f"state variable {name!r} is a {got.var.spec.kind} state, not a {kind} state: use "
                             f"state.{got.var.spec.kind}({name!r})")
        return got

    def value(self, name: str) -> TypedValue:
        return cast(TypedValue, self._view(name, "value"))

    def list(self, name: str) -> TypedList:
        return cast(TypedList, self._view(name, "list"))

    def map(self, name: str) -> TypedMap:
        return cast(TypedMap, self._view(name, "map"))
