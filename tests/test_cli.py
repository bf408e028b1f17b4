"""The ``omni`` command: ``plugins list`` (table and JSON schema), ``env``, and commands contributed by plugins."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omni_core import hookimpl
from omni_core.cli.main import main

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "docs/schemas/plugins-list.schema.json").read_text())
TYPES = {"string": str, "array": list, "object": dict, "boolean": bool, "null": type(None)}


def validate(value, schema, path="$"):
    """The JSON Schema subset the documented schema uses (type, enum, required, properties, items, additional)."""
    if "type" in schema:
        allowed = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        assert any(isinstance(value, TYPES[t]) for t in allowed), f"{path}: {value!r} is not {allowed}"
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
    if isinstance(value, dict):
        for key in schema.get("required", []):
            assert key in value, f"{path}: missing {key!r}"
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, item in value.items():
            if key in props:
                validate(item, props[key], f"{path}.{key}")
            elif extra is False:
                raise AssertionError(f"{path}: unexpected field {key!r}")
            elif isinstance(extra, dict):
                validate(item, extra, f"{path}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            validate(item, schema["items"], f"{path}[{i}]")


def test_validator_can_fail():
    with pytest.raises(AssertionError, match="unexpected field 'extra'"):
        validate([{"name": "x", "dist": "d", "version": "1", "status": "active", "builtin": False, "error": None,
                   "module": "m", "kinds": [], "components": {}, "model_names": {}, "extra": 1}], SCHEMA)
    with pytest.raises(AssertionError, match="not in"):
        validate([{"name": "x", "dist": "d", "version": "1", "status": "broken", "builtin": False, "error": None,
                   "module": "m", "kinds": [], "components": {}, "model_names": {}}], SCHEMA)


def test_plugins_list_json_schema_and_sdpa_active(run_omni):
    proc = run_omni("plugins", "list", "--json", "--all")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    validate(rows, SCHEMA)
    sdpa = next(r for r in rows if r["name"] == "attention-sdpa")
    assert sdpa["status"] == "active" and sdpa["components"] == {"attention": ["TORCH_SDPA"]}
    assert sdpa["dist"] == "omni-attention-sdpa" and sdpa["builtin"] is False and sdpa["error"] is None
    assert {r["name"] for r in rows if r["builtin"]} >= {"builtin-platform-cpu", "builtin-commands"}
    visible = json.loads(run_omni("plugins", "list", "--json").stdout)
    assert not any(r["builtin"] for r in visible) and "attention-sdpa" in {r["name"] for r in visible}


def test_validator_requires_model_names():
    with pytest.raises(AssertionError, match="missing 'model_names'"):
        validate([{"name": "x", "dist": "d", "version": "1", "status": "active", "builtin": False, "error": None,
                   "module": "m", "kinds": [], "components": {}}], SCHEMA)


def test_plugins_list_shows_model_short_names(run_omni):
    """What ``Omni(model=...)`` accepts is in the listing: ``shapes`` next to ShapesPipeline, text and JSON."""
    proc = run_omni("plugins", "list")
    assert proc.returncode == 0, proc.stderr
    row = next(line for line in proc.stdout.splitlines() if line.startswith("model-shapes"))
    assert row.split()[2:] == ["active", "pipeline", "ShapesPipeline", "(model=shapes)"]
    wan = next(line for line in proc.stdout.splitlines() if line.startswith("model-wan"))
    assert wan.split()[4:] == ["WanPipeline,", "WanImageToVideoPipeline"]  # no short names: folders only
    assert "or a diffusers folder whose model_index.json names a pipeline" in proc.stdout
    rows = json.loads(run_omni("plugins", "list", "--json", "--kind", "pipeline").stdout)
    validate(rows, SCHEMA)
    by_name = {r["name"]: r for r in rows}
    assert by_name["model-shapes"]["model_names"] == {"ShapesPipeline": ["shapes"]}
    assert by_name["model-wan"]["model_names"] == {}


def test_env_lists_pipelines_with_model_names(run_omni, capsys, omni_plugin_manager):
    proc = run_omni("env")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = lines.index("pipelines (model= takes a short name, or a diffusers folder naming the pipeline):")
    section = {line.split()[0]: line.split()[1:] for line in lines[start + 1:] if line.startswith("  ")}
    assert section["ShapesPipeline"] == ["omni-model-shapes", "model=shapes"]
    assert section["QwenImagePipeline"] == ["omni-model-qwen-image", "folder", "only"]
    assert main(["env", "--json"]) == 0
    pipelines = {p["name"]: p for p in json.loads(capsys.readouterr().out)["pipelines"]}
    assert pipelines["ShapesPipeline"] == {"name": "ShapesPipeline", "provider": "omni-model-shapes",
                                           "model_names": ["shapes"], "sampling_fields": []}


def test_plugins_list_table(run_omni):
    proc = run_omni("plugins", "list")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["Name", "Version", "Status", "Kinds", "Provides"]
    row = next(line for line in lines if line.startswith("attention-sdpa"))
    assert row.split() == ["attention-sdpa", "0.1.0", "active", "attention", "TORCH_SDPA"]
    assert "builtin-" not in proc.stdout and "--all shows them" in proc.stdout
    assert "builtin-schedulers" in run_omni("plugins", "list", "--all").stdout


def test_trace_plugins_prints_every_hook_call(run_omni, omni_env):
    """``OMNI_TRACE_PLUGINS=1``: hooks go through pluggy, so its tracer shows each call (and its result) on stderr,
    one plugin at a time; the command's own output is unchanged."""
    plain = run_omni("plugins", "list")
    proc = run_omni("plugins", "list", env=omni_env({"OMNI_TRACE_PLUGINS": "1"}))
    assert proc.returncode == 0 and proc.stdout == plain.stdout
    for hook in ("omni_register_commands", "omni_register_platforms", "omni_register_attention_backends",
                 "omni_register_cache_backends", "omni_register_pipelines", "omni_register_schedulers",
                 "omni_register_executors"):
        assert f"{hook} [hook]" in proc.stderr and f"finish {hook} -->" in proc.stderr, hook
    assert "name='TORCH_SDPA'" in proc.stderr  # the records each hook returned
    assert "[hook]" not in plain.stderr


def test_plugins_list_with_broken_and_conflicting(run_omni, omni_env, dummy_site):
    env = omni_env(site=dummy_site)
    proc = run_omni("plugins", "list", env=env)
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("dummy-broken"))
    assert lines[i].split() == ["dummy-broken", "0.0.1", "failed", "-", "-"]
    assert lines[i + 1].strip() == "reason: RuntimeError: omni-dummy-broken is broken on purpose"
    good = next(line for line in lines if line.startswith("dummy-good"))
    assert good.split()[:3] == ["dummy-good", "1.2.3", "active"]
    for part in ("attention: DUMMY_ATTN", "cache: dummy_cache", "platform: dummy"):
        assert part in good
    assert "omni: warning: omni plugin 'dummy-broken' (omni-dummy-broken 0.0.1) failed" in proc.stderr

    rows = json.loads(run_omni("plugins", "list", "--json", "--kind", "cache", env=env).stdout)
    validate(rows, SCHEMA)
    # plugins providing a cache backend (first-party ones included), plus the failed one (what it would
    # provide is unknown); nothing else
    assert {"dummy-good", "dummy-broken"} <= {r["name"] for r in rows}
    assert all("cache" in r["kinds"] or r["status"] == "failed" for r in rows)
    broken = next(r for r in rows if r["name"] == "dummy-broken")
    assert broken["status"] == "failed" and broken["error"].startswith("RuntimeError") and broken["kinds"] == []


def test_strict_mode_cli_fails_naming_the_distribution(run_omni, omni_env, dummy_site):
    proc = run_omni("plugins", "list", env=omni_env({"OMNI_STRICT_PLUGINS": "1"}, site=dummy_site))
    assert proc.returncode == 1 and proc.stdout == ""
    assert "omni: error: omni plugin 'dummy-broken' (omni-dummy-broken) failed to load: RuntimeError" in proc.stderr


def test_env_text(run_omni, omni_env, dummy_site):
    proc = run_omni("env", env=omni_env({"OMNI_DISABLE_PLUGINS": "dummy-broken"}, site=dummy_site))
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    import importlib.metadata as md

    assert f"torch         {md.version('torch')}" in out and "python        3." in out
    assert "diffusers" in out and "transformers" in out
    assert "switches      OMNI_DISABLE_PLUGINS=dummy-broken" in out
    assert "platform: cpu (device type cpu; no accelerator platform detected; CPU fallback)" in out
    assert "  dummy (omni-dummy-good): not detected: OMNI_DUMMY_PLATFORM is not 1" in out
    assert "dummy-broken (omni-dummy-broken) disabled: blocked by OMNI_DISABLE_PLUGINS" in out
    lines = out.splitlines()
    sdpa = next(line for line in lines if line.strip().startswith("TORCH_SDPA"))
    assert sdpa.split()[:4] == ["TORCH_SDPA", "*", "yes", "omni-attention-sdpa"]
    dummy = next(line for line in lines if line.strip().startswith("DUMMY_ATTN"))
    assert dummy.split()[1] == "no" and "several distributions: omni-dummy-conflict and omni-dummy-good" in dummy
    cache = next(line for line in lines if line.strip().startswith("dummy_cache"))
    assert cache.split()[1] == "no" and "needs the Python package(s) omni_dummy_missing_lib" in cache
    assert next(line for line in lines if line.strip().startswith("none ")).split()[1] == "yes"


def test_env_json(capsys, dummy_plugins, monkeypatch, use_manager):
    from omni_core.plugins.manager import create_plugin_manager

    monkeypatch.setenv("OMNI_DISABLE_PLUGINS", "dummy-broken,dummy-conflict")
    monkeypatch.setenv("OMNI_DUMMY_PLATFORM", "1")
    use_manager(create_plugin_manager())
    assert main(["env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["packages"]["torch"] and data["python"]["version"].startswith("3.")
    assert data["switches"]["OMNI_DISABLE_PLUGINS"] == "dummy-broken,dummy-conflict"
    assert data["platform"]["name"] == "dummy" and data["platform"]["reason"] == "the only detected platform"
    assert "dummy (omni-dummy-good): detected: OMNI_DUMMY_PLATFORM=1" in data["platform"]["trace"]
    att = {a["name"]: a for a in data["attention_backends"]}
    assert att["TORCH_SDPA"]["usable"] is True and att["TORCH_SDPA"]["platform_default"] is True
    assert att["DUMMY_ATTN"] == {"name": "DUMMY_ATTN", "provider": "omni-dummy-good", "usable": True, "reason": "",
                                 "platform_default": False}
    caches = {c["name"]: c for c in data["cache_backends"]}
    assert caches["none"]["usable"] and not caches["dummy_cache"]["usable"]


def test_env_reports_unresolvable_platform(capsys, omni_plugin_manager, monkeypatch):
    monkeypatch.setenv("OMNI_PLATFORM", "nope")
    assert main(["env", "--json"]) == 0
    plat = json.loads(capsys.readouterr().out)["platform"]
    assert plat["name"] is None and plat["error"].startswith("UnknownComponentError: unknown platform 'nope'")
    assert main(["env"]) == 0
    assert "platform: cannot be resolved: UnknownComponentError: unknown platform 'nope'" in capsys.readouterr().out


def test_usage(capsys, omni_plugin_manager):
    assert main([]) == 0 and "plugins" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["frobnicate"])
    assert exc.value.code == 2 and "invalid choice: 'frobnicate'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["plugins", "list", "--kind", "attn"])
    assert exc.value.code == 2
    assert main(["plugins"]) == 0 and "attention-sdpa" in capsys.readouterr().out  # `plugins` = `plugins list`


class _Hello:
    @hookimpl
    def omni_register_commands(self, subparsers):
        p = subparsers.add_parser("hello", help="say hello")
        p.add_argument("--name", default="world")
        p.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)


class _BadCommand:
    @hookimpl
    def omni_register_commands(self, subparsers):
        raise RuntimeError("command hook bug")


def test_plugin_command(capsys, register_omni_plugin):
    register_omni_plugin(_Hello(), "hello", dist="omni-hello")
    assert main(["hello", "--name", "omni"]) == 3  # the handler's return value is the exit code
    assert capsys.readouterr().out == "hello omni\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "say hello" in capsys.readouterr().out


def test_broken_plugin_command_is_isolated(capsys, omni_plugin_manager, register_omni_plugin):
    register_omni_plugin(_BadCommand(), "bad-command", dist="omni-bad-command")
    assert main(["plugins", "list"]) == 1  # strict (the fixture's default): an error naming the plugin
    assert "'bad-command' (omni-bad-command) failed to load: RuntimeError: command hook bug" in capsys.readouterr().err
    omni_plugin_manager.strict = False
    assert main(["plugins", "list", "--json"]) == 0
    captured = capsys.readouterr()
    bad = next(r for r in json.loads(captured.out) if r["name"] == "bad-command")
    assert bad["status"] == "failed" and bad["error"] == "omni_register_commands raised RuntimeError: command hook bug"
    assert "omni_register_commands raised RuntimeError" in captured.err
