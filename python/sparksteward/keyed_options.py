"""The options of ``Steward.keyed_state`` turned into the request's fields, checked in the caller so a
mistake is named at once (split from :mod:`sparksteward.client`)."""

from __future__ import annotations

from typing import Any

__all__ = ["alignment_overrides", "declarations", "merging_overrides"]


def merging_overrides(value: Any) -> dict[str, Any] | None:
    """``keyed_state(file_merging=...)`` as the request's overrides, checked here."""
    from sparksteward.checkpoint.filemerging.file_merger import MergingOptions
    from sparksteward.errors import ConfigError

    if value is None:
        return None
    if isinstance(value, bool):
        return {"enabled": value}
    keys = {"enabled", "max_file_size", "mode", "max_space_amplification"}
    if not isinstance(value, dict) or not set(value) <= keys:
        raise ConfigError(f"file_merging={value!r} must be True, False or a dict of {sorted(keys)}")
    MergingOptions.from_json({**MergingOptions().to_json(), **value})   # names a bad value
    return dict(value)


def alignment_overrides(alignment: Any, timeout: Any, max_inflight: Any) -> dict[str, Any] | None:
    """``keyed_state(alignment=..., ...)`` as the request's overrides, checked here (FLIP-76)."""
    from sparksteward.checkpoint.unaligned.channel_state import AlignmentOptions

    given = {k: v for k, v in (("alignment", alignment), ("aligned_checkpoint_timeout", timeout),
                               ("max_inflight_bytes", max_inflight)) if v is not None}
    if not given:
        return None
    AlignmentOptions.from_json({**AlignmentOptions().to_json(), **given})   # names a bad value
    return given


def declarations(states: list[Any] | None, delete_states: list[str] | None) -> tuple[list[dict[str, Any]] | None,
                                                                                   list[str]]:
    """The JSON form of ``states=`` and ``delete_states=``, checked here so a mistake is named at once."""
    from sparksteward.errors import StateSchemaError
    from sparksteward.state.declared import StateSpec

    if states is not None:
        if isinstance(states, (str, StateSpec)) or not hasattr(states, "__iter__"):
            raise StateSchemaError(f"states={states!r} must be a list of value_state(...), list_state(...) and "
                                   f"map_state(...) declarations")
        states = list(states)
        for s in states:
            if not isinstance(s, StateSpec):
                raise StateSchemaError(f"states=[...] holds {s!r}, which is not a declaration: make each with "
                                       f"value_state(...), list_state(...) or map_state(...)")
    dropped = list(delete_states or [])
    if not all(isinstance(n, str) and n for n in dropped):
        raise StateSchemaError(f"delete_states={delete_states!r} must be a list of state variable names")
    return (None if states is None else [s.to_json() for s in states]), dropped
