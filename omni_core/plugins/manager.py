"""The plugin manager: loads built-ins and entry points one by one, isolates failures, builds the registry.

Built-in plugins (CPU platform, ``none`` cache, schedulers, executors, commands) are registered with the same
``register`` call as entry-point plugins. Each entry point is loaded on its own: one that fails to import is
recorded as ``skipped`` (a missing optional dependency) or ``failed`` (anything else) and everything else keeps
working, unless strict mode is on. Hooks are always called through pluggy (so ``OMNI_TRACE_PLUGINS=1`` traces
them), one plugin at a time (:meth:`OmniPluginManager.call_each`), so a raising hook disables only its plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import logging
import os
import threading
from typing import Any, Iterable

import attrs
import pluggy

import omni_core.plugins.hookspecs as hookspecs
from omni_core.errors import (
    ComponentConflictError,
    PluginLoadError,
    UnknownComponentError,
    unknown_choice_message,
)
from omni_core.plugins.types import KINDS, ComponentSpec, kind_of

logger = logging.getLogger("omni_core.plugins")

ENTRY_POINT_GROUP = "omni_core.plugins"
CORE_DISTRIBUTION = "omni-core"

#: built-in plugins that are not tied to a kind (the CLI's own commands)
BUILTIN_COMMANDS: tuple[tuple[str, str], ...] = (
    ("builtin-commands", "omni_core.builtin.commands"),
    ("builtin-command-generate", "omni_core.builtin.command_generate"),
    ("builtin-command-serve", "omni_core.builtin.command_serve"),
)

#: modules of the core registered as built-in plugins (name -> module): each kind's, then the commands
BUILTIN_PLUGINS: dict[str, str] = dict([pair for kind in KINDS.values() for pair in kind.builtins]
                                       + list(BUILTIN_COMMANDS))

ACTIVE, SKIPPED, FAILED, DISABLED = "active", "skipped", "failed", "disabled"
STATUSES = (ACTIVE, SKIPPED, FAILED, DISABLED)

def _env_list(name: str) -> list[str] | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    return [item.strip() for item in raw.split(",") if item.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


@attrs.define
class PluginInfo:
    """What ``omni plugins list`` shows for one plugin."""

    name: str
    dist: str
    version: str
    status: str
    builtin: bool = False
    error: str | None = None
    module: str | None = None
    kinds: list[str] = attrs.field(factory=list)
    components: dict[str, list[str]] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


class OmniPluginManager(pluggy.PluginManager):
    """A pluggy manager with per-plugin failure isolation and a typed component registry."""

    def __init__(self, *, strict: bool = False) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        #: a plugin that fails to load (or whose registration hook raises) is an error, not a listing entry
        self.strict = strict
        self.infos: dict[str, PluginInfo] = {}
        self._registry: dict[str, dict[str, list[ComponentSpec]]] | None = None
        #: plugins whose hook raised (also those registered without a PluginInfo), until unregistered
        self._hook_failed: set[str] = set()
        self._records: list[ComponentSpec] = []
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- registration
    def register(self, plugin: Any, name: str | None = None) -> str | None:
        self._registry = None
        return super().register(plugin, name)

    def unregister(self, plugin: Any = None, name: str | None = None) -> Any:
        self._registry = None
        if name is None and plugin is not None:
            name = self.get_name(plugin)
        if name is not None:
            self.infos.pop(name, None)
            self._hook_failed.discard(name)
        return super().unregister(plugin, name)

    def register_plugin(self, plugin: Any, name: str, *, dist: str, version: str = "", builtin: bool = False) -> None:
        """Register ``plugin`` and record where it came from (used for listings and error messages)."""
        self.register(plugin, name=name)
        self.check_pending()
        self.infos[name] = PluginInfo(
            name=name, dist=dist, version=version, status=ACTIVE, builtin=builtin,
            module=getattr(plugin, "__name__", type(plugin).__name__),
        )

    def load_builtins(self) -> None:
        version = _dist_version(CORE_DISTRIBUTION)
        for name, module in BUILTIN_PLUGINS.items():
            if self.has_plugin(name):
                continue
            self.register_plugin(importlib.import_module(module), name, dist=CORE_DISTRIBUTION,
                                 version=version, builtin=True)

    def load_entrypoints(
        self,
        *,
        allow: Iterable[str] | None = None,
        block: Iterable[str] | None = None,
        strict: bool | None = None,
        entry_points: Iterable[md.EntryPoint] | None = None,
    ) -> None:
        """Load every plugin of the ``omni_core.plugins`` group, each in isolation.

        ``allow``/``block`` hold entry-point names (``OMNI_PLUGINS`` / ``OMNI_DISABLE_PLUGINS``); with
        ``strict`` (default: the manager's) a plugin that fails to load raises :class:`PluginLoadError`
        naming its distribution.
        """
        if strict is None:
            strict = self.strict
        eps = list(entry_points) if entry_points is not None else list(md.entry_points(group=ENTRY_POINT_GROUP))
        allow_set = set(allow) if allow is not None else None
        block_set = set(block or ())
        if allow_set is not None:
            unknown = allow_set - {ep.name for ep in eps}
            if unknown:
                logger.warning("OMNI_PLUGINS names plugins that are not installed: %s", ", ".join(sorted(unknown)))
        for ep in eps:
            dist_name, version = _ep_dist(ep)
            if self.has_plugin(ep.name) or ep.name in self.infos:
                first = self.infos.get(ep.name)
                if first is not None and first.dist != dist_name:
                    logger.warning("omni plugin entry point %r of %s ignored: the name is already taken by %s",
                                   ep.name, dist_name, first.dist)
                continue
            info = PluginInfo(name=ep.name, dist=dist_name, version=version, status=ACTIVE, module=ep.value)
            if ep.name in block_set or (allow_set is not None and ep.name not in allow_set):
                info.status = DISABLED
                info.error = "blocked by OMNI_DISABLE_PLUGINS" if ep.name in block_set else "not in OMNI_PLUGINS"
                self.set_blocked(ep.name)
                self.infos[ep.name] = info
                continue
            try:
                plugin = ep.load()
                self.register(plugin, name=ep.name)
                try:
                    self.check_pending()
                except pluggy.PluginValidationError:
                    self.unregister(name=ep.name)
                    raise
            except Exception as exc:  # noqa: BLE001 - isolation is the point
                info.status = SKIPPED if isinstance(exc, ImportError) else FAILED
                info.error = f"{type(exc).__name__}: {exc}"
                self.infos[ep.name] = info
                logger.warning("omni plugin %r (%s %s) %s: %s", ep.name, dist_name, version, info.status, info.error)
                logger.debug("traceback of plugin %r", ep.name, exc_info=True)
                if strict:
                    raise PluginLoadError(ep.name, dist_name, exc) from exc
                continue
            self.infos[ep.name] = info

    # ---------------------------------------------------------------- calling hooks
    def call_each(self, hook_name: str, *, registration_order: bool = False, **kwargs: Any) -> list[tuple[str, Any]]:
        """Call hook ``hook_name`` through pluggy for one active plugin at a time; ``[(plugin name, result)]``.

        A plugin whose implementation raises is marked ``failed`` (its components are dropped with it) and
        skipped, or, in strict mode, :class:`PluginLoadError` is raised. Order: pluggy's call order (tryfirst,
        newest first, trylast), or with ``registration_order`` the order the plugins were registered in.
        """
        impls = getattr(self.hook, hook_name).get_hookimpls()
        results = []
        for impl in (impls if registration_order else reversed(impls)):
            info = self.infos.get(impl.plugin_name)
            if impl.plugin_name in self._hook_failed or (info is not None and info.status != ACTIVE):
                continue
            try:
                # pluggy's own call path with one implementation: argument mapping, tracing, hook monitoring.
                # (``subset_hook_caller`` would do the same publicly but needs hashable plugin objects, and a
                # plugin may be any object, e.g. a namespace.)
                out = self._hookexec(hook_name, [impl], kwargs, False)
            except Exception as exc:  # noqa: BLE001 - a broken hook disables only its plugin
                self.fail_plugin(impl.plugin_name, f"{hook_name} raised {type(exc).__name__}: {exc}", exc)
                continue
            results.append((impl.plugin_name, out[0] if out else None))
        return results

    def fail_plugin(self, name: str, error: str, exc: BaseException) -> None:
        """Record that plugin ``name`` failed (``error`` is what listings show) and drop its components; in
        strict mode raise :class:`PluginLoadError` naming it and its distribution instead."""
        info = self.infos.get(name)
        dist = info.dist if info else name
        logger.warning("omni plugin %r (%s): %s", name, dist, error)
        if self.strict:  # the error stops the caller; nothing is recorded, so a later non-strict pass reports it
            raise PluginLoadError(name, dist, exc) from exc
        self._hook_failed.add(name)
        if info is not None:
            info.status, info.error = FAILED, error
        self._registry = None

    # ---------------------------------------------------------------- registry
    def _build_registry(self) -> list[ComponentSpec]:
        """Every active plugin's records, in call order (hooks called through :meth:`call_each`)."""
        # Two passes: collect every plugin's records first, so that a plugin whose hook raises (or returns
        # records of the wrong type) contributes nothing at all, not the records of the hooks that ran before.
        collected: list[tuple[str, str, ComponentSpec]] = []  # (kind, plugin name, record) in call order
        for kind in KINDS.values():
            for plugin, records in self.call_each(kind.hook):
                info = self.infos.get(plugin)
                records = list(records or ())
                bad = [rec for rec in records if not isinstance(rec, kind.record_cls)]
                if bad:
                    exc = TypeError(f"{kind.hook} must return {kind.record_cls.__name__} records, got {bad[0]!r}")
                    self.fail_plugin(plugin, f"{kind.hook} raised {type(exc).__name__}: {exc}", exc)
                    continue
                provider = info.dist if info else plugin
                collected.extend((kind.name, plugin, attrs.evolve(rec, provider=provider, plugin=plugin))
                                 for rec in records)
        return [rec for _, plugin, rec in collected if plugin not in self._hook_failed]

    @property
    def registry(self) -> dict[str, dict[str, list[ComponentSpec]]]:
        """``{kind: {name: [record, ...]}}``, rebuilt after the plugin set changes."""
        with self._lock:
            if self._registry is None:
                records = self._build_registry()
                registry: dict[str, dict[str, list[ComponentSpec]]] = {kind: {} for kind in KINDS}
                for rec in records:
                    registry[kind_of(rec).name].setdefault(rec.name, []).append(rec)
                self._records, self._registry = records, registry
            return self._registry

    def components(self, kind: str) -> dict[str, ComponentSpec]:
        """Registered components of ``kind`` by name (conflicting names map to their first provider)."""
        _check_kind(kind)
        return {name: recs[0] for name, recs in self.registry[kind].items()}

    def conflicts(self, kind: str | None = None) -> dict[tuple[str, str], list[str]]:
        """``{(kind, name): [dist, dist, ...]}`` for names registered by more than one distribution."""
        out = {}
        for k, by_name in self.registry.items():
            if kind is not None and k != kind:
                continue
            for name, recs in by_name.items():
                providers = sorted({r.provider for r in recs})
                if len(providers) > 1:
                    out[(k, name)] = providers
        return out

    def get_component(self, kind: str, name: str) -> ComponentSpec:
        """The record of ``kind`` called ``name``; a clear error if unknown or provided twice."""
        _check_kind(kind)
        recs = self.registry[kind].get(name)
        if not recs:
            msg = unknown_choice_message(KINDS[kind].label, name, self.registry[kind])
            broken = [i for i in self.infos.values() if i.status in (FAILED, SKIPPED)]
            if broken:
                msg += ("" if msg.endswith("?") else ".") + " Note: " + "; ".join(
                    f"plugin {i.name!r} ({i.dist}) {i.status}: {i.error}" for i in broken)
                msg += ". Run 'omni plugins list' for details"
            raise UnknownComponentError(msg)
        providers = sorted({r.provider for r in recs})
        if len(providers) > 1:
            raise ComponentConflictError(
                f"conflicting {KINDS[kind].label}s named {name!r}: provided by {' and '.join(providers)}. "
                f"Uninstall one, or block one with OMNI_DISABLE_PLUGINS=<entry point name>"
            )
        return recs[0]

    def load_component(self, kind: str, name: str) -> Any:
        """Import and return the implementation of component ``name``."""
        return self.get_component(kind, name).load()

    def list_plugins(self, include_builtin: bool = False) -> list[PluginInfo]:
        """Every plugin with its status and, from the registry, the kinds and components it provides."""
        with self._lock:
            self.registry  # noqa: B018 - built first: a plugin whose hook raises is listed as failed
            records = self._records
        provided: dict[str, dict[str, list[str]]] = {}
        for rec in records:  # in the order the hooks returned them
            provided.setdefault(rec.plugin, {}).setdefault(kind_of(rec).name, []).append(rec.name)
        return [attrs.evolve(i, kinds=list(provided.get(i.name, {})), components=provided.get(i.name, {}))
                for i in self.infos.values() if include_builtin or not i.builtin]


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(unknown_choice_message("component kind", kind, KINDS))


def _dist_version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "0+unknown"


def _ep_dist(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ep.name, ""
    return dist.metadata["Name"], dist.version


_manager: OmniPluginManager | None = None
_manager_lock = threading.Lock()


def create_plugin_manager(*, load_entrypoints: bool | None = None, strict: bool | None = None) -> OmniPluginManager:
    """A fresh manager with built-ins and (unless ``OMNI_NO_PLUGINS=1``) every installed entry point.

    ``strict`` defaults to ``OMNI_STRICT_PLUGINS``; a strict manager raises :class:`PluginLoadError` for a
    plugin that fails to import or whose registration hook raises.
    """
    if load_entrypoints is None:
        load_entrypoints = not _env_flag("OMNI_NO_PLUGINS")
    if strict is None:
        strict = _env_flag("OMNI_STRICT_PLUGINS")
    pm = OmniPluginManager(strict=strict)
    pm.load_builtins()
    if load_entrypoints:
        pm.load_entrypoints(allow=_env_list("OMNI_PLUGINS"), block=_env_list("OMNI_DISABLE_PLUGINS"))
    if _env_flag("OMNI_TRACE_PLUGINS"):
        pm.trace.root.setwriter(lambda msg: logger.warning("%s", msg.rstrip()))
        pm.enable_tracing()
    return pm


def get_plugin_manager() -> OmniPluginManager:
    """The process-wide plugin manager, created on first use."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = create_plugin_manager()
    return _manager


def set_plugin_manager(pm: OmniPluginManager | None) -> OmniPluginManager | None:
    """Install ``pm`` as the process-wide manager (``None`` resets); returns the previous one. For tests."""
    global _manager
    with _manager_lock:
        old, _manager = _manager, pm
    return old


def reset_plugin_manager() -> None:
    set_plugin_manager(None)


def get_installed_plugins(include_builtin: bool = False) -> list[dict[str, Any]]:
    """Plain-data listing of plugins (the ``omni plugins list --json`` payload)."""
    return [i.to_dict() for i in get_plugin_manager().list_plugins(include_builtin=include_builtin)]
