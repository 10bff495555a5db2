"""NVML sources: a small base class and a registry by name (``real``, ``fake``).

A source opens a module-like object that answers the pynvml API; everything above it (inventory,
metrics) is the same code whichever source is in use.
"""

from __future__ import annotations

from typing import Any, ClassVar

_SOURCES: dict[str, type[NvmlSource]] = {}


class NvmlSource:
    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _SOURCES[cls.name] = cls

    def open(self) -> Any:
        """Return an initialised module-like object that answers the pynvml functions."""
        raise NotImplementedError


def nvml_source(name: str, **options: Any) -> NvmlSource:
    try:
        source_class = _SOURCES[name]
    except KeyError:
        raise ValueError(f"unknown NVML source {name!r} (known: {', '.join(sorted(_SOURCES))})")
    return source_class(**options)
