"""The plugin manager with real installed distributions: discovery, isolation, strict mode, conflicts, lookups."""

from __future__ import annotations

import types

import pytest

from omni_core import hookimpl
from omni_core.errors import ComponentConflictError, PluginLoadError, UnknownComponentError
from omni_core.plugins.manager import BUILTIN_PLUGINS, create_plugin_manager
from omni_core.plugins.types import AttentionBackendSpec, CacheBackendSpec, PlatformSpec


def by_name(pm):
    return {info.name: info for info in pm.list_plugins(include_builtin=True)}


def test_builtins_and_installed_sdpa_are_active():
    pm = create_plugin_manager(strict=True)
    infos = by_name(pm)
    for name in BUILTIN_PLUGINS:
        assert infos[name].status == "active" and infos[name].builtin and infos[name].dist == "omni-core"
    sdpa = infos["attention-sdpa"]
    assert (sdpa.status, sdpa.dist, sdpa.builtin) == ("active", "omni-attention-sdpa", False)
    assert sdpa.components == {"attention": ["TORCH_SDPA"]}
    assert pm.get_component("attention", "TORCH_SDPA").provider == "omni-attention-sdpa"
    assert set(pm.components("executor")) >= {"uni", "mp"} and set(pm.components("scheduler")) >= {"request", "step"}
    assert "builtin-platform-cpu" not in {i.name for i in pm.list_plugins()}  # built-ins hidden by default


def test_good_broken_conflicting_distributions(dummy_plugins, use_manager, caplog):
    pm = use_manager(create_plugin_manager(strict=False))
    infos = by_name(pm)
    good, broken, conflict = infos["dummy-good"], infos["dummy-broken"], infos["dummy-conflict"]
    assert (good.status, good.dist, good.version) == ("active", "omni-dummy-good", "1.2.3")
    assert good.components == {"attention": ["DUMMY_ATTN"], "cache": ["dummy_cache"], "platform": ["dummy"]}
    assert broken.status == "failed" and broken.dist == "omni-dummy-broken"
    assert broken.error == "RuntimeError: omni-dummy-broken is broken on purpose"
    assert broken.components == {} and broken.kinds == []
    assert "dummy-broken" in caplog.text and "omni-dummy-broken" in caplog.text  # logged in one line
    assert conflict.status == "active"
    # everything else keeps working
    assert pm.load_component("attention", "TORCH_SDPA").name == "TORCH_SDPA"
    assert pm.get_component("cache", "dummy_cache").provider == "omni-dummy-good"
    # the clash names both distributions
    with pytest.raises(ComponentConflictError) as err:
        pm.get_component("attention", "DUMMY_ATTN")
    assert "omni-dummy-good" in str(err.value) and "omni-dummy-conflict" in str(err.value)
    assert pm.conflicts("attention")[("attention", "DUMMY_ATTN")] == ["omni-dummy-conflict", "omni-dummy-good"]


def test_unknown_name_mentions_failed_plugins(dummy_plugins):
    pm = create_plugin_manager(strict=False)
    with pytest.raises(UnknownComponentError) as err:
        pm.get_component("attention", "FLASH")
    msg = str(err.value)
    assert "'dummy-broken' (omni-dummy-broken) failed: RuntimeError" in msg and "omni plugins list" in msg


def test_strict_mode_raises_naming_the_distribution(dummy_plugins, monkeypatch):
    with pytest.raises(PluginLoadError, match="omni-dummy-broken") as err:
        create_plugin_manager(strict=True)
    assert err.value.dist == "omni-dummy-broken" and err.value.plugin == "dummy-broken"
    monkeypatch.setenv("OMNI_STRICT_PLUGINS", "1")  # the environment switch turns it on too
    with pytest.raises(PluginLoadError, match="omni-dummy-broken"):
        create_plugin_manager()


def test_good_component_becomes_selectable(dummy_plugins, monkeypatch, use_manager):
    import torch

    from omni_core.attention import Attention
    from omni_core.config import AttentionConfig, OmniDiffusionConfig

    monkeypatch.setenv("OMNI_DISABLE_PLUGINS", "dummy-conflict,dummy-broken")
    pm = use_manager(create_plugin_manager(strict=True))  # strict passes: the broken one is blocked
    infos = by_name(pm)
    assert infos["dummy-conflict"].status == "disabled" and "OMNI_DISABLE_PLUGINS" in infos["dummy-conflict"].error
    assert pm.get_component("attention", "DUMMY_ATTN").provider == "omni-dummy-good"
    config = OmniDiffusionConfig.from_kwargs(model="m", attention_backend="DUMMY_ATTN")  # validated against the registry
    layer = Attention(2, 8, attention_config=config.attention_config)
    assert layer.backend_name == "DUMMY_ATTN" and type(layer.impl).__module__ == "omni_dummy_good.backends"
    q, k, v = torch.randn(3, 1, 5, 2, 8).unbind(0)
    ref = Attention(2, 8, attention_config=AttentionConfig(default="TORCH_SDPA"))(q, k, v)
    torch.testing.assert_close(layer(q, k, v), ref)


def test_allow_list(dummy_plugins, monkeypatch):
    monkeypatch.setenv("OMNI_PLUGINS", "dummy-good,attention-sdpa")
    pm = create_plugin_manager(strict=True)
    infos = by_name(pm)
    assert infos["dummy-good"].status == "active" and infos["attention-sdpa"].status == "active"
    assert infos["dummy-broken"].status == "disabled" and infos["dummy-broken"].error == "not in OMNI_PLUGINS"
    assert set(pm.components("attention")) == {"TORCH_SDPA", "DUMMY_ATTN"}


def test_no_plugins_switch(dummy_plugins, monkeypatch):
    monkeypatch.setenv("OMNI_NO_PLUGINS", "1")
    pm = create_plugin_manager(strict=True)
    assert {i.name for i in pm.list_plugins(include_builtin=True)} == set(BUILTIN_PLUGINS)
    with pytest.raises(UnknownComponentError, match="allowed: \\(none\\)"):
        pm.get_component("attention", "TORCH_SDPA")


def test_unknown_component_suggests_closest(omni_plugin_manager):
    with pytest.raises(UnknownComponentError) as err:
        omni_plugin_manager.get_component("attention", "TORCH_SPDA")
    available = ", ".join(sorted(omni_plugin_manager.components("attention")))  # other plugins may be installed
    assert str(err.value) == (f"unknown attention backend 'TORCH_SPDA'; allowed: {available}. "
                              "Did you mean 'TORCH_SDPA'?")
    with pytest.raises(UnknownComponentError, match="allowed: .*mp, .*uni.*Did you mean 'uni'"):
        omni_plugin_manager.get_component("executor", "unii")
    with pytest.raises(ValueError, match="unknown component kind 'attn'.*Did you mean 'attention'"):
        omni_plugin_manager.components("attn")


def test_register_fixture_adds_and_removes(omni_plugin_manager, register_omni_plugin):
    plugin = types.SimpleNamespace(omni_register_cache_backends=hookimpl(
        lambda: [CacheBackendSpec(name="test_cache", impl="omni_core.cache.base:CacheBackend")]))
    register_omni_plugin(plugin, "test-cache", dist="omni-test-cache")
    assert omni_plugin_manager.get_component("cache", "test_cache").provider == "omni-test-cache"
    assert by_name(omni_plugin_manager)["test-cache"].components == {"cache": ["test_cache"]}
    omni_plugin_manager.unregister(plugin)
    assert "test_cache" not in omni_plugin_manager.components("cache")
    assert "test-cache" not in by_name(omni_plugin_manager)


def test_registry_rebuild_is_idempotent(omni_plugin_manager, register_omni_plugin):
    before = by_name(omni_plugin_manager)["attention-sdpa"].components
    register_omni_plugin(types.SimpleNamespace(omni_register_platforms=hookimpl(lambda: [])), "empty")
    omni_plugin_manager.components("attention")  # rebuilt after the registration
    assert by_name(omni_plugin_manager)["attention-sdpa"].components == before == {"attention": ["TORCH_SDPA"]}


class _HalfBroken:
    """Registers an attention backend fine, then its cache hook raises."""

    @hookimpl
    def omni_register_attention_backends(self):
        return [AttentionBackendSpec(name="HALF", impl="omni_attention_sdpa.backend:TorchSDPABackend")]

    @hookimpl
    def omni_register_cache_backends(self):
        raise RuntimeError("cache hook bug")


def test_raising_hook_disables_the_whole_plugin():
    pm = create_plugin_manager(strict=False)
    pm.register_plugin(_HalfBroken(), "half-broken", dist="omni-half-broken")
    assert "HALF" not in pm.components("attention")  # no half-registered plugin
    info = by_name(pm)["half-broken"]
    assert info.status == "failed" and info.error == "omni_register_cache_backends raised RuntimeError: cache hook bug"
    assert "TORCH_SDPA" in pm.components("attention")


def test_raising_hook_in_strict_mode(omni_plugin_manager, register_omni_plugin):
    register_omni_plugin(_HalfBroken(), "half-broken", dist="omni-half-broken")
    with pytest.raises(PluginLoadError, match="'half-broken' \\(omni-half-broken\\) failed to load: RuntimeError"):
        omni_plugin_manager.components("attention")


def test_wrong_record_type_is_a_failure(omni_plugin_manager, register_omni_plugin):
    plugin = types.SimpleNamespace(omni_register_platforms=hookimpl(
        lambda: [AttentionBackendSpec(name="X", impl="a:b")]))
    register_omni_plugin(plugin, "confused")
    with pytest.raises(PluginLoadError, match="must return PlatformSpec records"):
        omni_plugin_manager.components("platform")


def test_records_validate_their_fields():
    with pytest.raises(ValueError, match="impl must be a 'module:attr' string, got 'not-a-path'"):
        AttentionBackendSpec(name="X", impl="not-a-path")
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        PlatformSpec(name=" ", impl="a:b")
    assert PlatformSpec(name="p", impl="a:b").detect is None


def test_hook_validation_error_is_isolated(dummy_plugins):
    """A hookimpl with an unknown hook name (a typo) fails its plugin, not the manager."""
    pm = create_plugin_manager(strict=False)
    typo = types.ModuleType("typo")
    typo.omni_register_attention_backend = hookimpl(lambda: [])  # missing 's'
    with pytest.raises(Exception, match="unknown hook 'omni_register_attention_backend'"):
        pm.register_plugin(typo, "typo", dist="omni-typo")
