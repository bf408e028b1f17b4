"""Role-aware attention backend selection: the five resolution levels, and clear errors."""

from __future__ import annotations

import sys
import types

import pytest

from omni_core import hookimpl
from omni_core.attention.selector import select_attention_backend
from omni_core.config import AttentionConfig, ConfigError, OmniDiffusionConfig
from omni_core.errors import ComponentUnavailableError, UnknownComponentError
from omni_core.plugins.types import AttentionBackendSpec

SDPA = "omni_attention_sdpa.backend:TorchSDPABackend"


@pytest.fixture
def levels(register_omni_plugin, monkeypatch):
    """Four extra names for the same kernel, one per configurable level, so each level's choice is visible.

    Each name is its own subclass of the SDPA backend, since a class states the name it is registered as."""
    from omni_attention_sdpa.backend import TorchSDPABackend

    monkeypatch.delenv("OMNI_ATTENTION_BACKEND", raising=False)
    names = ("BY_ROLE", "BY_CATEGORY", "BY_DEFAULT", "BY_ENV")
    module = types.ModuleType("omni_selector_levels")
    for name in names:
        setattr(module, name, type(name, (TorchSDPABackend,), {"name": name}))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    register_omni_plugin(types.SimpleNamespace(omni_register_attention_backends=hookimpl(lambda: [
        AttentionBackendSpec(name=name, impl=f"{module.__name__}:{name}") for name in names
    ] + [AttentionBackendSpec(name="NEEDS_LIB", impl=SDPA, requires=("omni_no_such_lib",))])),
        "selector-test", dist="omni-selector-test")


def select(config, role="joint", category="self", **kw):
    sel = select_attention_backend(role, head_size=64, role_category=category, attention_config=config, **kw)
    return sel.name, sel.source


def test_five_levels_in_order(levels, monkeypatch):
    full = AttentionConfig(default="BY_DEFAULT", per_role={"joint": "BY_ROLE", "self": "BY_CATEGORY"})
    monkeypatch.setenv("OMNI_ATTENTION_BACKEND", "BY_ENV")
    # 1. per_role[role]
    assert select(full) == ("BY_ROLE", "per_role['joint']")
    # 2. per_role[role_category]
    no_role = AttentionConfig(default="BY_DEFAULT", per_role={"self": "BY_CATEGORY"})
    assert select(no_role) == ("BY_CATEGORY", "per_role['self'] (role category)")
    # 3. the config's default
    assert select(AttentionConfig(default="BY_DEFAULT", per_role={"cross": "BY_ROLE"})) == (
        "BY_DEFAULT", "attention_config.default")
    # 4. OMNI_ATTENTION_BACKEND
    assert select(AttentionConfig()) == ("BY_ENV", "OMNI_ATTENTION_BACKEND")
    assert select(None) == ("BY_ENV", "OMNI_ATTENTION_BACKEND")
    # 5. the platform's default
    monkeypatch.delenv("OMNI_ATTENTION_BACKEND")
    assert select(AttentionConfig()) == ("TORCH_SDPA", "platform default (cpu)")


def test_platform_default_comes_from_the_platform(levels):
    class Platform:
        name = "fake"

        def default_attention_backend(self, head_size, dtype):
            return "BY_DEFAULT" if head_size == 64 else "TORCH_SDPA"

    assert select(AttentionConfig(), platform=Platform()) == ("BY_DEFAULT", "platform default (fake)")


def test_backend_options_reach_the_impl(levels):
    from omni_core.attention import Attention

    layer = Attention(2, 8, role="cross", attention_config=AttentionConfig(
        per_role={"cross": {"backend": "BY_ROLE", "options": {"window": 4}}}))
    assert layer.impl.options == {"window": 4} and layer.selection.spec.options == {"window": 4}


def test_unknown_backend_lists_available_and_suggests(levels):
    with pytest.raises(UnknownComponentError) as err:
        select(AttentionConfig(per_role={"joint": "BY_ROLLE"}))
    assert "allowed: " in str(err.value) and "BY_CATEGORY" in str(err.value) and "TORCH_SDPA" in str(err.value)
    assert str(err.value).endswith("Did you mean 'BY_ROLE'?")


def test_unknown_backend_in_engine_config_is_a_config_error(levels):
    with pytest.raises(ConfigError, match="attention_config: unknown attention backend 'torch_sdpa'.*"
                                          "Did you mean 'TORCH_SDPA'") as err:
        OmniDiffusionConfig.from_kwargs(model="m", attention_config={"per_role": {"cross": "torch_sdpa"}})
    assert err.value.field == "attention_config"


def test_explicit_choice_that_cannot_run_says_why(levels):
    with pytest.raises(ComponentUnavailableError) as err:
        select(AttentionConfig(per_role={"self": "NEEDS_LIB"}))
    msg = str(err.value)
    assert "'NEEDS_LIB'" in msg and "per_role['self'] (role category)" in msg and "omni_no_such_lib" in msg


def test_unsupported_head_size_is_refused(register_omni_plugin):
    from omni_core.attention.backend import AttentionBackend

    class Only64(AttentionBackend):
        name = "ONLY_64"
        supported_head_sizes = (64, 128)

    import sys

    module = types.ModuleType("omni_test_only64")
    module.Only64 = Only64
    sys.modules["omni_test_only64"] = module
    try:
        register_omni_plugin(types.SimpleNamespace(omni_register_attention_backends=hookimpl(
            lambda: [AttentionBackendSpec(name="ONLY_64", impl="omni_test_only64:Only64")])), "only64")
        assert select(AttentionConfig(default="ONLY_64"))[0] == "ONLY_64"
        with pytest.raises(ComponentUnavailableError, match="does not support head size 40; supported: 64, 128"):
            select_attention_backend("self", head_size=40, attention_config=AttentionConfig(default="ONLY_64"))
    finally:
        del sys.modules["omni_test_only64"]


def test_not_a_backend_class_is_refused(register_omni_plugin):
    register_omni_plugin(types.SimpleNamespace(omni_register_attention_backends=hookimpl(
        lambda: [AttentionBackendSpec(name="NOT_A_BACKEND", impl="omni_core.config:AttentionConfig")])), "bad")
    with pytest.raises(TypeError, match="must be an AttentionBackend subclass"):
        select(AttentionConfig(default="NOT_A_BACKEND"))


def test_layer_reads_the_config_being_loaded(levels):
    from omni_core.attention import Attention
    from omni_core.forward_context import use_config

    config = OmniDiffusionConfig.from_kwargs(model="m", attention_config={
        "default": "BY_DEFAULT", "per_role": {"cross": "BY_ROLE"}})
    with use_config(config):
        cross, joint = Attention(2, 8, role="cross"), Attention(2, 8, role="joint", role_category="self")
    assert (cross.backend_name, joint.backend_name) == ("BY_ROLE", "BY_DEFAULT")
    assert Attention(2, 8).backend_name == "TORCH_SDPA"  # outside: the platform default
    cross.set_backend("BY_ENV")
    assert cross.backend_name == "BY_ENV" and cross.selection.source == "attention_config.default"


def test_platform_default_comes_from_the_records():
    """No name in the core: the highest default_priority that passes the walk, else the portable record."""
    from omni_core.platforms.cpu import CpuPlatform
    from omni_core.testing.kernel_stand_ins import FAST, PORTABLE, stand_in_kernels

    cpu = CpuPlatform()
    with stand_in_kernels(fast_devices=("cpu",)):
        assert cpu.default_attention_backend(64, "bfloat16") == FAST  # runs here, ranks higher
        assert cpu.default_attention_backend(64, None) == PORTABLE  # float32 (the CPU's dtype): not fast's
        assert select(AttentionConfig(), dtype="bfloat16") == (FAST, "platform default (cpu)")
    with stand_in_kernels(fast_ok=False, fast_devices=("cpu",)):
        assert cpu.default_attention_backend(64, "bfloat16") == PORTABLE
    with stand_in_kernels(fast_devices=("cpu",)):
        cpu.fast_attention_allowed = lambda: (False, None)  # a platform that allows no fast kernel here
        assert cpu.default_attention_backend(64, "bfloat16") == PORTABLE


def test_no_attention_plugin_is_an_error_naming_the_kind():
    from omni_core.attention.defaults import default_backend
    from omni_core.plugins.manager import OmniPluginManager

    pm = OmniPluginManager(strict=True)
    pm.load_builtins()
    with pytest.raises(ComponentUnavailableError, match="no attention backend plugin is installed.*plugin kind "
                                                        "'attention'"):
        default_backend(device_type="cpu", dtype="float32", head_size=64, pm=pm)
