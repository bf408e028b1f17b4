"""``omni env``: versions, the platform resolution trace, and which attention/cache backends can run here.

Versions come from package metadata (nothing heavy is imported for them). The pipelines section lists each
pipeline's short model names (what ``Omni(model=...)`` accepts besides a folder). Checking whether a backend is
usable imports its class (so torch, for most), unless its declared ``requires`` are already missing.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import platform as py_platform
import sys
from typing import Any

PACKAGES = ("omni-core", "torch", "diffusers", "transformers", "accelerate", "safetensors", "cache-dit", "pluggy",
            "attrs")
SWITCHES = ("OMNI_PLUGINS", "OMNI_DISABLE_PLUGINS", "OMNI_STRICT_PLUGINS", "OMNI_NO_PLUGINS", "OMNI_PLATFORM",
            "OMNI_ATTENTION_BACKEND")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", help="versions, platform resolution, and which backends are usable here",
                              description="Describe this environment: versions, how the platform was resolved, "
                                          "and for every attention and cache backend whether it can run here.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_env)


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _platform_report(pm) -> tuple[dict[str, Any], Any]:
    from omni_core.platforms import resolve_platform

    try:
        res = resolve_platform(pm)
    except Exception as exc:  # noqa: BLE001 - env must describe a broken setup, not crash on it
        return {"name": None, "device_type": None, "reason": None, "trace": [],
                "error": f"{type(exc).__name__}: {exc}"}, None
    return {"name": res.name, "device_type": res.platform.device_type, "reason": res.reason, "trace": res.trace,
            "error": None}, res.platform


def _usable(spec, base_cls: type, conflicts: dict, kind: str, platform) -> tuple[bool, str]:
    """Whether the component can run here and, if not, why. Imports the class only if its requirements exist."""
    from omni_core.plugins.types import missing_requirements

    if (kind, spec.name) in conflicts:
        return False, f"name registered by several distributions: {' and '.join(conflicts[(kind, spec.name)])}"
    missing = missing_requirements(spec.requires)
    if missing:
        return False, f"needs the Python package(s) {', '.join(missing)}, which are not installed"
    try:
        cls = spec.load()
    except Exception as exc:  # noqa: BLE001
        return False, f"cannot import {spec.impl}: {type(exc).__name__}: {exc}"
    if not (isinstance(cls, type) and issubclass(cls, base_cls)):
        return False, f"{spec.impl} is not a {base_cls.__name__} subclass"
    try:
        ok, why = cls.is_available()
    except Exception as exc:  # noqa: BLE001
        return False, f"is_available() raised {type(exc).__name__}: {exc}"
    if not ok:
        return False, why
    devices = getattr(cls, "supported_devices", None)
    if platform is not None and devices is not None and platform.device_type not in devices:
        return False, f"does not run on device type {platform.device_type!r} (supports {', '.join(devices)})"
    return True, ""


def collect_env(pm=None) -> dict[str, Any]:
    """The ``omni env --json`` payload."""
    from omni_core.attention.backend import AttentionBackend
    from omni_core.cache.base import CacheBackend
    from omni_core.plugins.manager import ACTIVE, CORE_DISTRIBUTION, get_plugin_manager

    pm = pm or get_plugin_manager()
    platform_info, platform = _platform_report(pm)
    conflicts = pm.conflicts()
    default_backend = None
    if platform is not None:
        try:
            default_backend = platform.default_attention_backend(128, platform.default_dtype)
        except Exception:  # noqa: BLE001
            default_backend = None
    attention = []
    for name, spec in sorted(pm.components("attention").items()):
        ok, why = _usable(spec, AttentionBackend, conflicts, "attention", platform)
        attention.append({"name": name, "provider": spec.provider, "usable": ok, "reason": why,
                          "platform_default": name == default_backend})
    cache = [{"name": "none", "provider": CORE_DISTRIBUTION, "usable": True, "reason": "", "platform_default": False}]
    for name, spec in sorted(pm.components("cache").items()):
        ok, why = _usable(spec, CacheBackend, conflicts, "cache", platform)
        cache.append({"name": name, "provider": spec.provider, "usable": ok, "reason": why, "platform_default": False})
    # what Omni(model=...) accepts: a pipeline's short names, or a folder naming the pipeline
    pipelines = [{"name": name, "provider": spec.provider, "model_names": list(spec.model_names)}
                 for name, spec in sorted(pm.components("pipeline").items())]
    plugins = pm.list_plugins(include_builtin=True)
    return {
        "omni_core": _version("omni-core"),
        "python": {"version": py_platform.python_version(), "executable": sys.executable},
        "os": f"{py_platform.system()} {py_platform.release()} {py_platform.machine()}",
        "packages": {dist: _version(dist) for dist in PACKAGES},
        "switches": {k: os.environ[k] for k in SWITCHES if k in os.environ},
        "platform": platform_info,
        "plugins": {"total": len(plugins), "active": sum(p.status == ACTIVE for p in plugins),
                    "not_active": [{"name": p.name, "dist": p.dist, "status": p.status, "error": p.error}
                                   for p in plugins if p.status != ACTIVE]},
        "attention_backends": attention,
        "cache_backends": cache,
        "pipelines": pipelines,
    }


def _backend_lines(rows: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["name"]) + (2 if r["platform_default"] else 0) for r in rows)
    pwidth = max(len(r["provider"]) for r in rows)
    out = []
    for r in rows:
        name = r["name"] + (" *" if r["platform_default"] else "")
        usable = "yes" if r["usable"] else "no "
        out.append(f"  {name.ljust(width)}  {usable}  {r['provider'].ljust(pwidth)}  {r['reason']}".rstrip())
    return out


def format_env(env: dict[str, Any]) -> str:
    lines = [f"omni-core     {env['omni_core']}",
             f"python        {env['python']['version']}  ({env['python']['executable']})",
             f"os            {env['os']}"]
    for dist, version in env["packages"].items():
        if dist != "omni-core":
            lines.append(f"{dist:<13} {version or 'not installed'}")
    switches = ", ".join(f"{k}={v}" for k, v in env["switches"].items()) or "(none set)"
    lines.append(f"switches      {switches}")
    plat = env["platform"]
    lines.append("")
    if plat["error"]:
        lines.append(f"platform: cannot be resolved: {plat['error']}")
    else:
        lines.append(f"platform: {plat['name']} (device type {plat['device_type']}; {plat['reason']})")
    lines += [f"  {step}" for step in plat["trace"]]
    p = env["plugins"]
    lines.append("")
    lines.append(f"plugins: {p['active']} of {p['total']} active (built-ins included)")
    lines += [f"  {x['name']} ({x['dist']}) {x['status']}: {x['error']}" for x in p["not_active"]]
    lines.append("")
    lines.append("attention backends (usable here? * = platform default):")
    lines += _backend_lines(env["attention_backends"]) if env["attention_backends"] else ["  (none registered)"]
    lines.append("")
    lines.append("cache backends (usable here?):")
    lines += _backend_lines(env["cache_backends"])
    lines.append("")
    lines.append("pipelines (model= takes a short name, or a diffusers folder naming the pipeline):")
    lines += _pipeline_lines(env["pipelines"]) if env["pipelines"] else ["  (none: install a model plugin, e.g. "
                                                                         "omni-model-shapes)"]
    return "\n".join(lines)


def _pipeline_lines(rows: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["name"]) for r in rows)
    pwidth = max(len(r["provider"]) for r in rows)
    return [f"  {r['name'].ljust(width)}  {r['provider'].ljust(pwidth)}  "
            f"{'model=' + ', '.join(r['model_names']) if r['model_names'] else 'folder only'}" for r in rows]


def run_env(args: argparse.Namespace) -> int:
    env = collect_env()
    print(json.dumps(env, indent=2) if args.json else format_env(env))
    return 0
