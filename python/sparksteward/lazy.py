"""Lazy package faces: a package exports names whose modules load on first use (PEP 562), so a process
that needs one module of a package (the driver agent, the CLI) does not load them all."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_face"]


def lazy_face(package: str, exports: Mapping[str, str],
              namespace: dict[str, Any]) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of package ``package``: ``exports`` maps each exported name to
    its module under the package; a name is imported on first use and then kept in ``namespace`` (the
    package's globals)."""

    def getattr_(name: str) -> object:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *exports})

    return getattr_, dir_
