"""Options of the selected executor: ``<executor>_<name>=`` keywords collected and checked against what the
executor declares."""

from __future__ import annotations

from omni_core.errors import ConfigError


def executor_option_names() -> dict[str, dict[str, str]]:
    """``{executor: {option: help}}`` of every registered executor that declares options (imports their classes,
    which must stay light: an executor imports its heavy libraries in ``start``)."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    out = {}
    for name in sorted(pm.components("executor")):
        try:
            options = getattr(pm.load_component("executor", name), "options", None) or {}
        except Exception:  # noqa: BLE001 - an unusable executor has no options to offer
            continue
        if options:
            out[name] = dict(options)
    return out


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


def _check_executor_options(executor: str, options: dict) -> None:
    """Every key of ``executor_options`` must be an option the executor declares."""
    from omni_core.plugins.manager import get_plugin_manager

    cls = get_plugin_manager().load_component("executor", executor)
    declared = getattr(cls, "options", None) or {}
    for key in options:
        if key not in declared:
            allowed = ", ".join(f"{executor}_{n}" for n in declared) or "none"
            raise ConfigError(f"executor {executor!r} has no option {key!r}; its options: {allowed}",
                              field="executor_options")
    check = getattr(cls, "check_options", None)  # the executor's own checks of the values
    if check is not None:
        check(dict(options))
