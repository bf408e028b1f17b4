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

import attrs

PACKAGES = ("omni-core", "torch", "diffusers", "transformers", "accelerate", "safetensors", "cache-dit", "pluggy",
            "attrs")
SWITCHES = ("OMNI_PLUGINS", "OMNI_DISABLE_PLUGINS", "OMNI_STRICT_PLUGINS", "OMNI_NO_PLUGINS", "OMNI_PLATFORM",
            "OMNI_ATTENTION_BACKEND")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("env", help="versions, platform resolution, and which backends are usable here",
                              description="Describe this environment: versions, how the platform was resolved, "
                                          "and for every attention and cache backend whether it can run here.")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--model", default=None,
                   help="also print what each performance_mode (speed, memory, auto) would choose for this model here")
    p.add_argument("--diffusers", action="store_true",
                   help="list every pipeline class of the installed diffusers and how it runs here (natively, through "
                        "the pipeline that serves any folder, or not at all); imports diffusers")
    p.add_argument("--plan", action="store_true",
                   help="with --model: print the load plan (where the weights are at each step, in which order the "
                        "options apply) for the engine options given")
    from omni_core.cli.options import add_engine_options

    add_engine_options(p)
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


def _backend_rows(pm, kind: str, platform, conflicts: dict, default: str | None = None) -> list[dict[str, Any]]:
    """One row per registered component of ``kind`` (the core's built-ins first): whether it can run on this
    platform (:func:`~omni_core.plugins.availability.check_record`) and, if not, why."""
    from omni_core.plugins.availability import Context, check_record
    from omni_core.plugins.manager import CORE_DISTRIBUTION

    ctx = Context(device_type=platform.device_type if platform is not None else None)
    rows = []
    for name, spec in sorted(pm.components(kind).items(), key=lambda kv: (kv[1].provider != CORE_DISTRIBUTION,
                                                                            kv[0])):
        if (kind, name) in conflicts:
            ok, why = False, f"name registered by several distributions: {' and '.join(conflicts[(kind, name)])}"
        else:
            av = check_record(spec, ctx)
            ok, why = av.ok, av.reason
        rows.append({"name": name, "provider": spec.provider, "usable": ok, "reason": why,
                     "platform_default": name == default,
                     **({"options": [o.to_dict() for o in spec.options]} if hasattr(spec, "options") else {})})
    return rows


def collect_env(pm=None, model: str | None = None, plan_options: dict[str, Any] | None = None,
                diffusers: bool = False) -> dict[str, Any]:
    """The ``omni env --json`` payload; with ``plan_options`` (engine options) and ``model``, the load plan; with
    ``diffusers``, how each diffusers pipeline class runs here."""
    from omni_core.cli.coverage import coverage_rows, summary_line
    from omni_core.plugins.manager import ACTIVE, get_plugin_manager

    pm = pm or get_plugin_manager()
    platform_info, platform = _platform_report(pm)
    conflicts = pm.conflicts()
    default_backend = None
    if platform is not None:
        try:
            default_backend = platform.default_attention_backend(128, platform.default_dtype)
        except Exception:  # noqa: BLE001
            default_backend = None
    attention = _backend_rows(pm, "attention", platform, conflicts, default_backend)
    cache = _backend_rows(pm, "cache", platform, conflicts)
    # what Omni(model=...) accepts: a pipeline's short names, or a folder naming the pipeline
    pipelines = [{"name": name, "provider": spec.provider, "model_names": list(spec.model_names),
                  "sampling_fields": [f.to_dict() for f in spec.sampling_fields]}
                 for name, spec in sorted(pm.components("pipeline").items())]
    # executors that take options (``<executor>_<name>=`` / ``--<executor>-<name>``)
    executors = [{"name": name, "provider": spec.provider, "options": [o.to_dict() for o in spec.options]}
                 for name, spec in sorted(pm.components("executor").items())]
    plugins = pm.list_plugins(include_builtin=True)
    return {
        "omni_core": _version("omni-core"),
        "python": {"version": py_platform.python_version(), "executable": sys.executable},
        "os": f"{py_platform.system()} {py_platform.release()} {py_platform.machine()}",
        "packages": {dist: _version(dist) for dist in PACKAGES},
        "switches": {k: os.environ[k] for k in SWITCHES if k in os.environ},
        "platform": platform_info,
        "cpu_threads": _thread_report(),
        "plugins": {"total": len(plugins), "active": sum(p.status == ACTIVE for p in plugins),
                    "not_active": [{"name": p.name, "dist": p.dist, "status": p.status, "error": p.error}
                                   for p in plugins if p.status != ACTIVE]},
        "attention_backends": attention,
        "cache_backends": cache,
        "executors": executors,
        "pipelines": pipelines,
        "any_folder": summary_line(pm),
        **({"diffusers_classes": coverage_rows(pm)} if diffusers else {}),
        "quantization": _quantization_rows(platform),
        **({"performance_modes": _preset_report(pm, model, platform)} if model else {}),
        **({"load_plan": _plan_report(pm, model, platform, plan_options)} if model and plan_options is not None
           else {}),
    }


def _plan_report(pm, model: str, platform, options: dict[str, Any]) -> dict[str, Any]:
    """The load plan of ``model`` with engine ``options`` on this platform's first device (after the
    ``performance_mode`` preset fills unset options), as ``omni generate``/``serve`` would run it."""
    from omni_core.config import OmniDiffusionConfig
    from omni_core.optimize.plan import plan_load
    from omni_core.optimize.presets import apply_preset
    from omni_core.pipelines.loader import resolve_model

    try:
        config = OmniDiffusionConfig(model=model, **options)
        device = platform.get_torch_device(0)
        config, _ = apply_preset(config, resolve_model(model, pm).model_path, device)
        steps = plan_load(config, device)
    except Exception as exc:  # noqa: BLE001 - env describes, it does not crash
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"device": str(device), "steps": [attrs.asdict(step) for step in steps],
            "lines": [step.describe() for step in steps]}


def _quantization_rows(platform) -> list[dict[str, Any]]:
    """Whether each quantization method (torchao int8/fp8, GGUF files) can run on this platform, and why not."""
    from omni_core.optimize.quantize import METHODS, gguf_status, method_status

    kind = platform.device_type if platform is not None else "cpu"
    rows = [{"name": m, "usable": ok, "reason": why} for m in METHODS for ok, why in [method_status(m, kind)]]
    ok, why = gguf_status()
    return rows + [{"name": "gguf", "usable": ok, "reason": why}]


def _preset_report(pm, model: str, platform) -> dict[str, Any]:
    """What ``performance_mode`` speed/memory/auto would set for ``model`` on this platform (omni env --model)."""
    from omni_core.config import OmniDiffusionConfig
    from omni_core.optimize.presets import MODES, choose
    from omni_core.pipelines.loader import resolve_model

    try:
        path = resolve_model(model, pm).model_path
        device = platform.get_torch_device(0)
        return {mode: choose(OmniDiffusionConfig(model=model, performance_mode=mode), path, device)[1]
                for mode in MODES}
    except Exception as exc:  # noqa: BLE001 - env describes, it does not crash
        return {"error": f"{type(exc).__name__}: {exc}"}


def _thread_report() -> dict[str, Any]:
    from omni_core.platforms.threads import CGROUP_ROOT, ContentionGauge, threads_per_process, usable_cpu_cores

    gauge = ContentionGauge()
    return {"usable_cores": usable_cpu_cores(), "per_model_process": threads_per_process(None),
            "policy": "cpu_threads, else usable cores (affinity, capped by the cgroup CPU quota) / model processes, "
                      "one while the CPU is contended (--cpu-threads N fixes it)",
            "cgroup_root": os.environ.get("OMNI_CGROUP_ROOT") or CGROUP_ROOT,
            "contention_signal": gauge.path if gauge.available else "none (no /proc/pressure/cpu): never lowered"}


def _backend_lines(rows: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["name"]) + (2 if r["platform_default"] else 0) for r in rows)
    pwidth = max(len(r["provider"]) for r in rows)
    out = []
    for r in rows:
        name = r["name"] + (" *" if r["platform_default"] else "")
        usable = "yes" if r["usable"] else "no "
        out.append(f"  {name.ljust(width)}  {usable}  {r['provider'].ljust(pwidth)}  {r['reason']}".rstrip())
        out += _option_lines(r.get("options", ()))
    return out


def _option_lines(options, prefix: str = "") -> list[str]:
    """One line per declared option (the record's ``to_dict``): ``name: what it takes, default: help``."""
    return [f"      {prefix}{o['name']}: {o['allowed']}" + ("" if o["default"] is None else f", default {o['default']!r}")
            + (f": {o['help']}" if o["help"] else "") for o in options]


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
    threads = env["cpu_threads"]
    lines.append(f"cpu threads: {threads['per_model_process']} per model process of one ({threads['usable_cores']} "
                 f"usable cores; {threads['policy']})")
    p = env["plugins"]
    lines.append("")
    lines.append(f"plugins: {p['active']} of {p['total']} active (built-ins included)")
    lines += [f"  {x['name']} ({x['dist']}) {x['status']}: {x['error']}" for x in p["not_active"]]
    lines.append("")
    lines.append("attention backends (usable here? * = platform default):")
    lines += _backend_lines(env["attention_backends"]) if env["attention_backends"] else ["  (none registered)"]
    lines.append("")
    lines.append("cache backends (usable here?; cache_config keys):")
    lines += _backend_lines(env["cache_backends"])
    executors = [e for e in env.get("executors", []) if e["options"]]
    if executors:
        lines.append("")
        lines.append("executor options (<executor>_<name>= / --<executor>-<name>):")
        for e in executors:
            lines.append(f"  {e['name']} ({e['provider']})")
            lines += _option_lines(e["options"], prefix=f"{e['name']}_")
    lines.append("")
    lines.append("pipelines (model= takes a short name, or a diffusers folder naming the pipeline):")
    lines += _pipeline_lines(env["pipelines"]) if env["pipelines"] else ["  (none: install a model plugin, e.g. "
                                                                         "omni-model-shapes)"]
    if env.get("any_folder"):
        lines.append(f"  {env['any_folder']}")
    if "diffusers_classes" in env:
        rows = env["diffusers_classes"]
        counts = {k: sum(r["runs"] == k for r in rows) for k in ("native", "modular steps", "own call", "not served")}
        lines.append("")
        lines.append(f"diffusers pipeline classes ({len(rows)}: {counts['native']} native, {counts['modular steps']} "
                     f"step-wise through diffusers' modular blocks, {counts['own call']} through their own call only, "
                     f"{counts['not served']} not served):")
        width = max((len(r["class"]) for r in rows), default=0)
        lines += [f"  {r['class'].ljust(width)}  {r['runs']:<13}  {r['by']}"
                  + (f": {r['gives']}" if r["runs"] == "not served" else "") for r in rows]
    lines.append("")
    lines.append("quantization methods (usable here?):")
    lines += [f"  {r['name']:<5} {'yes' if r['usable'] else 'no '}  {r['reason']}" for r in env["quantization"]]
    if "performance_modes" in env:
        lines.append("")
        modes = env["performance_modes"]
        if "error" in modes:
            lines.append(f"performance_mode: cannot be chosen: {modes['error']}")
        for mode, r in ({} if "error" in modes else modes).items():
            lines.append(f"performance_mode={mode}: {r.get('reason')}; chose {r.get('chose') or 'nothing'}"
                         + (f", kept {r['kept']}" if r.get("kept") else "")
                         + f" (weights {r['weight_bytes'] / 2**20:.1f} MiB, free {r['free_bytes'] / 2**30:.1f} GiB)")
    if "load_plan" in env:
        lines.append("")
        plan = env["load_plan"]
        if "error" in plan:
            lines.append(f"load plan: cannot be made: {plan['error']}")
        else:
            lines.append(f"load plan (target {plan['device']}; step, components -> where their weights are):")
            lines += [f"  {i}. {line}" for i, line in enumerate(plan["lines"], 1)]
    return "\n".join(lines)


def _pipeline_lines(rows: list[dict[str, Any]]) -> list[str]:
    width = max(len(r["name"]) for r in rows)
    pwidth = max(len(r["provider"]) for r in rows)
    out = []
    for r in rows:
        out.append(f"  {r['name'].ljust(width)}  {r['provider'].ljust(pwidth)}  "
                   f"{'model=' + ', '.join(r['model_names']) if r['model_names'] else 'folder only'}")
        out += _option_lines(r.get("sampling_fields", ()))
    return out


def run_env(args: argparse.Namespace) -> int:
    from omni_core.cli.options import engine_options
    from omni_core.errors import ConfigError

    if getattr(args, "plan", False) and not args.model:
        raise ConfigError("omni env --plan needs --model (the plan depends on the model's folder and the options)",
                          field="model")
    env = collect_env(model=getattr(args, "model", None),
                      plan_options=engine_options(args) if getattr(args, "plan", False) else None,
                      diffusers=getattr(args, "diffusers", False))
    print(json.dumps(env, indent=2) if args.json else format_env(env))
    return 0
