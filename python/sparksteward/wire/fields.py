"""Typed access to the fields of one request, for op handlers: a wrong type is refused with
``INVALID_REQUEST`` naming the op, the field, the value and what was expected."""

from __future__ import annotations

import math
from typing import Any

from sparksteward.errors import InvalidRequestError
from sparksteward.ids import validate_job_id

__all__ = ["Fields"]

_REQUIRED: Any = object()


def _show(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Fields:
    """Typed access to one request's fields, for op handlers.

    Each getter returns the field's value or raises :class:`InvalidRequestError` naming the op,
    the field, the value and the expected type. A field with a ``default`` may be missing or null.
    """

    def __init__(self, req: dict[str, Any]) -> None:
        self.req = req
        self.op = str(req.get("op"))

    def _get(self, name: str, default: Any) -> tuple[bool, Any]:
        value = self.req.get(name)
        if value is None:
            if default is _REQUIRED:
                self._bad(name, value, "a value" if name in self.req else "this field, which is required")
            return False, default
        return True, value

    def _bad(self, name: str, value: object, expected: str) -> None:
        shown = _show(value) if name in self.req else "(missing)"
        raise InvalidRequestError(f"{self.op}: field {name!r} = {shown} is not valid: expected {expected}")

    def text(self, name: str, *, default: Any = _REQUIRED, choices: tuple[str, ...] = (),
             max_len: int = 1 << 16) -> Any:
        present, value = self._get(name, default)
        if present:
            if not isinstance(value, str) or len(value) > max_len:
                self._bad(name, value, f"a string of at most {max_len} characters")
            if choices and value not in choices:
                self._bad(name, value, "one of " + ", ".join(repr(c) for c in choices))
        return value

    def flag(self, name: str, *, default: Any = _REQUIRED) -> Any:
        present, value = self._get(name, default)
        if present and not isinstance(value, bool):
            self._bad(name, value, "a JSON boolean (true or false)")
        return value

    def integer(self, name: str, *, default: Any = _REQUIRED, lo: int | None = None, hi: int | None = None) -> Any:
        present, value = self._get(name, default)
        if present and (not isinstance(value, int) or isinstance(value, bool)
                        or (lo is not None and value < lo) or (hi is not None and value > hi)):
            self._bad(name, value, f"an integer{_range(lo, hi)}")
        return value

    def number(self, name: str, *, default: Any = _REQUIRED, lo: float | None = None, hi: float | None = None) -> Any:
        present, value = self._get(name, default)
        if present:
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or (lo is not None and value < lo) or (hi is not None and value > hi)):
                self._bad(name, value, f"a finite number{_range(lo, hi)}")
            value = float(value)
        return value

    def mapping(self, name: str, *, default: Any = _REQUIRED) -> Any:
        present, value = self._get(name, default)
        if present and not isinstance(value, dict):
            self._bad(name, value, "a JSON object")
        return value

    def sequence(self, name: str, *, default: Any = _REQUIRED, max_items: int = 1024) -> Any:
        present, value = self._get(name, default)
        if present and (not isinstance(value, list) or len(value) > max_items):
            self._bad(name, value, f"a JSON array of at most {max_items} items")
        return value

    def job_id(self, name: str = "job_id", *, nullable: bool = False) -> Any:
        """A job id, validated; the field must be present, and may be null only if ``nullable``."""
        if name not in self.req:
            self._bad(name, None, "a job id" + (" or null" if nullable else ""))
        value = self.req[name]
        if value is None:
            if not nullable:
                self._bad(name, value, "a job id (this op needs one)")
            return None
        if not isinstance(value, str):
            self._bad(name, value, "a job id string" + (" or null" if nullable else ""))
        return validate_job_id(value)


def _range(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f" from {lo} to {hi}"
    if lo is not None:
        return f" >= {lo}"
    return f" <= {hi}" if hi is not None else ""

