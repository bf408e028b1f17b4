"""Options plugins declare for the engine's config (:class:`~omni_core.options.Option` records on their registration
records, read without importing the plugin): an executor's ``<executor>_<name>=`` keywords, collected into
``executor_options``, and a cache backend's ``cache_config`` keys. Both are checked when the config is built, by
:func:`~omni_core.options.validate_options`."""

from __future__ import annotations

from typing import Any

from omni_core.errors import ConfigError
from omni_core.options import Option, validate_options


def declared_options(kind: str) -> dict[str, tuple[Option, ...]]:
    """``{component: options}`` of every registered ``kind`` component (``"executor"``, ``"cache"``) that declares
    options, from the records (nothing is imported)."""
    from omni_core.plugins.manager import get_plugin_manager

    return {name: tuple(spec.options) for name, spec in sorted(get_plugin_manager().components(kind).items())
            if getattr(spec, "options", ())}


def executor_option_names() -> dict[str, dict[str, str]]:
    """``{executor: {option: help}}`` of every registered executor that declares options."""
    return {name: {o.name: o.help for o in options} for name, options in declared_options("executor").items()}


def _collect_executor_options(kwargs: dict, fields: list[str]) -> None:
    """Move ``<executor>_<name>`` keywords of the selected executor into ``executor_options`` (in place); a known
    option of another executor is an error naming the executor it belongs to."""
    if not any(key not in fields and "_" in key for key in kwargs):
        return
    executor = kwargs.get("executor")
    declared = executor_option_names()
    collected = dict(kwargs.get("executor_options") or {})
    for key in [k for k in kwargs if k not in fields]:
        for name, options in declared.items():
            prefix = f"{name}_"
            if key.startswith(prefix) and key[len(prefix):] in options:
                if executor != name:
                    raise ConfigError(f"{key} is an option of executor {name!r}; pass executor={name!r} "
                                      f"(omni serve --executor {name}) to use it", field=key)
                collected[key[len(prefix):]] = kwargs.pop(key)
    if collected:
        kwargs["executor_options"] = collected


def _record(kind: str, name: str) -> Any:
    from omni_core.plugins.manager import get_plugin_manager

    return get_plugin_manager().get_component(kind, name)


def _check_executor_options(executor: str, options: dict) -> None:
    """Every key of ``executor_options`` must be an option the executor declares, with a valid value."""
    validate_options(options, _record("executor", executor).options, prefix=f"{executor}_",
                     owner=f"an option of executor {executor!r}", field="executor_options")


def _check_cache_options(backend: str, config: dict) -> None:
    """``cache_config`` against the keys the cache backend declares (a backend that declares none checks its own
    in ``check_config``)."""
    options = getattr(_record("cache", backend), "options", ())
    if options:
        validate_options(config, options, prefix="cache_config.", owner=f"a {backend} option")
