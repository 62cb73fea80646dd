"""What the enums of settings and records share: :class:`ParsedEnum`, whose ``parse`` takes a member or
its text and refuses anything else with the enum's own error.

A subclass says how text is read (:meth:`ParsedEnum._text`: lower case by default; override it for
aliases or another case) and how a bad value is refused (:meth:`ParsedEnum._refusal`: the error to
raise, with a message that names the value and the allowed ones). Members are ``str`` values, so a
member serialises as its value.
"""

from __future__ import annotations

import enum
from typing import TypeVar

__all__ = ["ParsedEnum"]

E = TypeVar("E", bound="ParsedEnum")


class ParsedEnum(str, enum.Enum):
    """A ``str`` enum with :meth:`parse`. Subclasses define :meth:`_refusal` (and may define :meth:`_text`)."""

    @classmethod
    def parse(cls: type[E], value: object) -> E:
        """``value`` as a member: a member itself, or text that :meth:`_text` reads as a member's value.

        Raises
        ------
        StewardError
            The subclass's own error (:meth:`_refusal`) for any other value.
        """
        if isinstance(value, cls):
            return value
        try:
            return cls(cls._text(value))  # None, the text of no value, is no member either
        except ValueError:
            raise cls._refusal(value) from None

    @classmethod
    def _text(cls, value: object) -> str | None:
        """The member value ``value`` stands for (``str(value)`` in lower case here); None refuses it."""
        return str(value).lower()

    @classmethod
    def _refusal(cls, value: object) -> Exception:
        """The error that refuses ``value``: what was wrong and the values that are allowed."""
        raise NotImplementedError(f"{cls.__name__} must say how it refuses a value ({value!r})")
