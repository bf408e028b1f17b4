"""Exception types users and plugin authors can catch. Import-light on purpose."""

from __future__ import annotations

import difflib
from typing import Iterable


class OmniError(Exception):
    """Base class of every error Omni raises on purpose."""


class ConfigError(OmniError, ValueError):
    """A configuration or sampling field has a bad value; the message names field, value and what is allowed."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class PluginLoadError(OmniError):
    """A plugin failed to load (raised only in strict mode; otherwise the failure is recorded)."""

    def __init__(self, plugin: str, dist: str | None, error: BaseException | str):
        self.plugin, self.dist, self.error = plugin, dist, error
        where = f" ({dist})" if dist else ""
        err = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        super().__init__(f"omni plugin {plugin!r}{where} failed to load: {err}")


class UnknownComponentError(OmniError, KeyError):
    """No registered component of a kind has the requested name."""

    def __str__(self) -> str:  # KeyError quotes its message otherwise
        return str(self.args[0])


class ComponentConflictError(OmniError):
    """Two distributions register a component of the same kind under the same name."""


class ComponentUnavailableError(OmniError, RuntimeError):
    """A component was chosen explicitly but cannot run here (library missing, wrong device, ...)."""


class EngineDeadError(OmniError, RuntimeError):
    """The engine's workers died; every in-flight and later request fails with this."""


class CollectiveCallError(OmniError, RuntimeError):
    """A collective call (``collective_rpc``) failed on at least one rank; ``ranks`` says which, ``errors`` why
    (rank -> traceback text). Every rank ran the call: the failure is agreed, as a wave's is."""

    def __init__(self, message: str, *, ranks: list[int] | None = None, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.ranks = list(ranks or [])
        self.errors = dict(errors or {})


class QueueFullError(OmniError):
    """The engine's waiting queue is at ``max_waiting_requests``; retry later (the server answers 429)."""


class ResidencyError(OmniError):
    """A served model cannot be brought onto the device now: the memory budget is held by models with work in
    flight (``holders``), and the contention policy is to fail (or its wait timed out). The server answers 503."""

    def __init__(self, message: str, *, model: str = "", holders: list[str] | None = None):
        super().__init__(message)
        self.model = model
        self.holders = list(holders or [])


class PlatformResolutionError(OmniError):
    """Two platforms claim this machine, or the requested one cannot run here."""


class RequestFailedError(OmniError):
    """A request ended with an error; ``outputs`` holds every output of the call (failed ones included)."""

    def __init__(self, message: str, outputs: list | None = None):
        super().__init__(message)
        self.outputs = outputs or []


def suggest(name: str, choices: Iterable[str]) -> str | None:
    """The closest match to ``name`` among ``choices`` (case-insensitive), or None."""
    choices = list(choices)
    lowered = {c.lower(): c for c in choices}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[match[0]] if match else None


def unknown_choice_message(what: str, name: object, choices: Iterable[str]) -> str:
    """'Unknown X 'y'. Allowed: a, b. Did you mean 'a'?'"""
    choices = sorted(choices)
    msg = f"unknown {what} {name!r}; allowed: {', '.join(choices) if choices else '(none)'}"
    hint = suggest(str(name), choices)
    if hint is not None:
        msg += f". Did you mean {hint!r}?"
    return msg


class RecordMismatchError(PluginLoadError, ComponentUnavailableError):
    """A plugin's class restates a field of its registration record (``name``, ``requires``,
    ``supported_parallel``) with another value; the record is the truth, so the plugin is at fault."""

    def __init__(self, message: str, *, plugin: str = "", dist: str = "", field: str = ""):
        OmniError.__init__(self, message)
        self.plugin, self.dist, self.error, self.field = plugin, dist, message, field
