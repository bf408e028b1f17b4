"""Lazy package exports: a package names its public objects as ``"module:attr"`` strings and imports each on
first access, so importing the package stays light (no torch, FastAPI, ...).

Usage, in a package's ``__init__.py``::

    _LAZY = {"Thing": "mypkg.impl:Thing"}
    __all__ = sorted(_LAZY)
    __getattr__ = lazy_exports(__name__, _LAZY)
    __dir__ = lazy_dir(__name__, _LAZY)
"""

from __future__ import annotations

import pkgutil
import sys
from typing import Any, Callable, Mapping


def lazy_exports(module_name: str, mapping: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves ``mapping[name]`` on first access and caches it in the module,
    so later accesses are plain attribute lookups. Unknown names raise the usual AttributeError."""

    def __getattr__(name: str) -> Any:
        target = mapping.get(name)
        if target is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = pkgutil.resolve_name(target)
        setattr(sys.modules[module_name], name, value)
        return value

    return __getattr__


def lazy_dir(module_name: str, mapping: Mapping[str, str]) -> Callable[[], list[str]]:
    """A module ``__dir__`` listing the loaded attributes and the lazy names alike."""

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[module_name])) | set(mapping))

    return __dir__
