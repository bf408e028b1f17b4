"""Kinds described once, the record as the truth (a class that disagrees is its plugin's error), the one
availability walk, and the built-in ``none`` cache."""

from __future__ import annotations

import sys
import types

import pytest

from omni_core import hookimpl
from omni_core.errors import ComponentUnavailableError, PluginLoadError, RecordMismatchError
from omni_core.plugins import hookspecs
from omni_core.plugins.availability import Context, check_component
from omni_core.plugins.manager import BUILTIN_PLUGINS, create_plugin_manager
from omni_core.plugins.types import KINDS, AttentionBackendSpec, CacheBackendSpec, PipelineSpec


def test_each_kind_is_described_once():
    """Record type, hook, label, base class and built-ins come from one KindSpec; the rest is derived."""
    registration_hooks = {n for n in dir(hookspecs) if n.startswith("omni_register_") and n != "omni_register_commands"}
    assert {k.hook for k in KINDS.values()} == registration_hooks
    for name, kind in KINDS.items():
        assert kind.name == name and isinstance(kind.base(), type)
        for plugin, module in kind.builtins:
            assert BUILTIN_PLUGINS[plugin] == module
    pm = create_plugin_manager(load_entrypoints=False, strict=True)
    with pytest.raises(Exception, match="unknown cache backend 'nope'; allowed: none"):
        pm.get_component("cache", "nope")  # the label comes from the descriptor


@pytest.fixture
def mismatched(register_omni_plugin, monkeypatch):
    """A plugin whose classes restate their records' fields with other values (SAGE_ATTN's old requires)."""
    from omni_attention_sdpa.backend import TorchSDPABackend

    from omni_core.pipelines.base import OmniPipeline

    module = types.ModuleType("omni_test_mismatch")
    module.Misnamed = type("Misnamed", (TorchSDPABackend,), {"name": "SOMETHING_ELSE"})
    module.MoreRequires = type("MoreRequires", (TorchSDPABackend,), {"name": "MORE_REQUIRES",
                                                                     "requires": ("torch", "sageattention")})
    module.Agrees = type("Agrees", (TorchSDPABackend,), {"name": "AGREES", "requires": ("torch",)})
    module.MoreParallel = type("MoreParallel", (OmniPipeline,), {"supported_parallel": ("ulysses", "ring", "cfg")})
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Plugin:
        @hookimpl
        def omni_register_attention_backends(self):
            return [AttentionBackendSpec(name="MISNAMED", impl="omni_test_mismatch:Misnamed"),
                    AttentionBackendSpec(name="MORE_REQUIRES", impl="omni_test_mismatch:MoreRequires",
                                         requires=("torch",)),
                    AttentionBackendSpec(name="AGREES", impl="omni_test_mismatch:Agrees", requires=("torch",))]

        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="MoreParallel", impl="omni_test_mismatch:MoreParallel",
                                 supported_parallel=("cfg",))]

    return register_omni_plugin(Plugin(), "mismatch", dist="omni-mismatch")


@pytest.mark.parametrize(("kind", "name", "field", "stated", "recorded"), [
    ("attention", "MISNAMED", "name", "'SOMETHING_ELSE'", "'MISNAMED'"),
    ("attention", "MORE_REQUIRES", "requires", "('torch', 'sageattention')", "('torch',)"),
    ("pipeline", "MoreParallel", "supported_parallel", "('ulysses', 'ring', 'cfg')", "('cfg',)"),
])
def test_class_disagreeing_with_its_record_is_the_plugins_error(omni_plugin_manager, mismatched, kind, name, field,
                                                                stated, recorded):
    with pytest.raises(RecordMismatchError) as info:
        omni_plugin_manager.load_component(kind, name)
    err = info.value
    assert (err.plugin, err.dist, err.field) == ("mismatch", "omni-mismatch", field)
    assert isinstance(err, PluginLoadError) and isinstance(err, ComponentUnavailableError)
    msg = str(err)
    assert f"{name!r} of plugin 'mismatch' (omni-mismatch)" in msg
    assert f"states {field}={stated}" in msg and f"its record says {field}={recorded}" in msg
    av = check_component(kind, name, pm=omni_plugin_manager)
    assert not av.ok and av.step == "record" and av.reason == msg


def test_pipeline_class_declaring_other_sampling_fields_than_its_record_is_refused(register_omni_plugin,
                                                                                  omni_plugin_manager, monkeypatch):
    """A pipeline's sampling fields are validated from its record (no import); a class that declares different
    ones would accept or default what the record does not say, so loading it is the plugin's error."""
    from omni_core.pipelines.base import OmniPipeline
    from omni_core.sampling_fields import SamplingField

    scale = SamplingField(name="knob_scale", type="float", default=1.0, min=0.0, max=10.0)
    module = types.ModuleType("omni_test_fields_mismatch")
    module.Knobs = type("Knobs", (OmniPipeline,), {"sampling_fields": (scale,)})
    module.Same = type("Same", (OmniPipeline,), {"sampling_fields": (scale,)})
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Plugin:
        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="Knobs", impl="omni_test_fields_mismatch:Knobs",
                                 sampling_fields=(SamplingField(name="knob_scale", type="float", default=2.0),)),
                    PipelineSpec(name="Same", impl="omni_test_fields_mismatch:Same", sampling_fields=(scale,))]

    register_omni_plugin(Plugin(), "fields-mismatch", dist="omni-fields-mismatch")
    with pytest.raises(RecordMismatchError) as info:
        omni_plugin_manager.load_component("pipeline", "Knobs")
    assert info.value.field == "sampling_fields" and "'Knobs' of plugin 'fields-mismatch'" in str(info.value)
    assert omni_plugin_manager.load_component("pipeline", "Same") is module.Same


def test_class_agreeing_with_its_record_loads(omni_plugin_manager, mismatched):
    assert omni_plugin_manager.load_component("attention", "AGREES").name == "AGREES"


def test_the_selector_reports_a_mismatch(omni_plugin_manager, mismatched):
    from omni_core.attention.selector import select_attention_backend
    from omni_core.config import AttentionConfig

    with pytest.raises(RecordMismatchError, match="states name='SOMETHING_ELSE'"):
        select_attention_backend("self", head_size=64, attention_config=AttentionConfig(default="MISNAMED"))


def test_omni_env_reports_a_mismatch(omni_plugin_manager, mismatched):
    from omni_core.cli.env import collect_env

    rows = {r["name"]: r for r in collect_env(omni_plugin_manager)["attention_backends"]}
    assert not rows["MISNAMED"]["usable"] and "states name='SOMETHING_ELSE'" in rows["MISNAMED"]["reason"]
    assert rows["AGREES"]["usable"]


def test_first_party_classes_agree_with_their_records():
    """Every installed component whose requirements are present loads without a mismatch."""
    from omni_core.plugins.types import missing_requirements

    pm = create_plugin_manager(strict=True)
    for kind in ("platform", "attention", "cache", "pipeline", "scheduler", "executor"):
        for spec in pm.components(kind).values():
            if not missing_requirements(spec.requires):
                spec.load()


# ---------------------------------------------------------------- the availability walk
@pytest.fixture
def walk(register_omni_plugin, monkeypatch):
    from omni_core.attention.backend import AttentionBackend

    module = types.ModuleType("omni_test_walk")

    class Unavailable(AttentionBackend):
        name = "UNAVAILABLE"

        @classmethod
        def is_available(cls):
            return False, "no kernel here"

    class Limited(AttentionBackend):
        name = "LIMITED"
        supported_head_sizes = (64,)
        supported_dtypes = ("float16",)
        supported_devices = ("cuda",)

        @classmethod
        def check_capability(cls, capability):
            major, minor = capability
            return None if capability >= (8, 0) else f"LIMITED needs sm80+, this GPU is sm{major}{minor}"

    module.Unavailable, module.Limited = Unavailable, Limited
    module.NotABackend = object
    monkeypatch.setitem(sys.modules, module.__name__, module)
    register_omni_plugin(types.SimpleNamespace(omni_register_attention_backends=hookimpl(lambda: [
        AttentionBackendSpec(name="NEEDS_LIB", impl="omni_test_walk:Limited", requires=("omni_no_such_lib",)),
        AttentionBackendSpec(name="NO_MODULE", impl="omni_test_walk_gone:X"),
        AttentionBackendSpec(name="NOT_A_BACKEND", impl="omni_test_walk:NotABackend"),
        AttentionBackendSpec(name="UNAVAILABLE", impl="omni_test_walk:Unavailable"),
        AttentionBackendSpec(name="LIMITED", impl="omni_test_walk:Limited"),
    ])), "walk", dist="omni-walk")


@pytest.mark.parametrize(("name", "ctx", "step", "reason"), [
    ("NEEDS_LIB", Context(), "requires", "needs the Python package(s) omni_no_such_lib, which are not installed"),
    ("NO_MODULE", Context(), "import", "cannot import omni_test_walk_gone:X: ModuleNotFoundError"),
    ("NOT_A_BACKEND", Context(), "base", "omni_test_walk:NotABackend is not a AttentionBackend subclass"),
    ("UNAVAILABLE", Context(), "is_available", "no kernel here"),
    ("LIMITED", Context(head_size=80), "head_size", "LIMITED does not support head size 80; supported: 64"),
    ("LIMITED", Context(dtype="float32", device_type="cuda"), "call", "LIMITED does not support dtype float32"),
    ("LIMITED", Context(device_type="cpu"), "device", "does not run on device type 'cpu' (supports cuda)"),
    ("LIMITED", Context(capability=(7, 5)), "capability", "LIMITED needs sm80+, this GPU is sm75"),
    ("LIMITED", Context(head_size=64, dtype="float16", device_type="cuda", capability=(9, 0)), None, ""),
])
def test_the_walk_stops_at_the_first_failing_step(omni_plugin_manager, walk, name, ctx, step, reason):
    av = check_component("attention", name, ctx, pm=omni_plugin_manager)
    assert av.step == step and av.ok is (step is None) and reason in av.reason


# ---------------------------------------------------------------- the ``none`` cache
def test_none_cache_is_a_builtin_component():
    from omni_core.cache import CacheBackend

    pm = create_plugin_manager(load_entrypoints=False, strict=True)
    spec = pm.get_component("cache", "none")
    assert isinstance(spec, CacheBackendSpec)
    assert (spec.provider, spec.plugin) == ("omni-core", "builtin-cache-none")
    cls = pm.load_component("cache", "none")
    assert issubclass(cls, CacheBackend) and check_component("cache", "none", pm=pm).ok
    cls.check_config({})  # what the engine asks of every cache backend before workers start
    cls.check_config({"ignored": 1})  # without a cache, cache_config is ignored, as before
    backend = cls({})
    backend.enable(object())
    state = types.SimpleNamespace(cache_state={"stale": 1})
    backend.begin_request(state)
    assert state.cache_state == {} and backend.request_metrics(state) == {}
    backend.disable(object())


def test_none_is_validated_like_any_cache_backend(monkeypatch):
    """No special case: with no plugins at all, "none" is still registered (by the core) and a typo lists it."""
    from omni_core.config import ConfigError, OmniDiffusionConfig
    from omni_core.plugins.manager import set_plugin_manager

    previous = set_plugin_manager(create_plugin_manager(load_entrypoints=False, strict=True))
    try:
        assert OmniDiffusionConfig(model="m").cache_backend == "none"
        with pytest.raises(ConfigError, match=r"unknown cache backend 'nnone'; allowed: none\. Did you mean 'none'\?"):
            OmniDiffusionConfig(model="m", cache_backend="nnone")
    finally:
        set_plugin_manager(previous)


def test_a_class_leaving_record_fields_out_reads_the_records_values(register_omni_plugin, omni_plugin_manager,
                                                                    monkeypatch):
    """State once, on the record: a class that leaves a field out (or inherits a base's, such as
    DiffusersStepPipeline's parallel strategies) loads and reads the record's value, so the workers' checks and
    the messages that read the class agree with what discovery saw."""
    from omni_attention_sdpa.backend import TorchSDPABackend

    from omni_core.pipelines.diffusers_step import DiffusersStepPipeline

    module = types.ModuleType("omni_test_adopt")
    module.Narrow = type("Narrow", (DiffusersStepPipeline,), {})  # inherits ("ulysses", "ring", "cfg")
    module.Unnamed = type("Unnamed", (TorchSDPABackend,), {"name": ""})
    module.Inherits = type("Inherits", (TorchSDPABackend,), {})
    monkeypatch.setitem(sys.modules, module.__name__, module)

    class Plugin:
        @hookimpl
        def omni_register_pipelines(self):
            return [PipelineSpec(name="Narrow", impl="omni_test_adopt:Narrow", supported_parallel=("cfg",))]

        @hookimpl
        def omni_register_attention_backends(self):
            return [AttentionBackendSpec(name="UNNAMED", impl="omni_test_adopt:Unnamed", requires=("torch",)),
                    AttentionBackendSpec(name="INHERITS", impl="omni_test_adopt:Inherits")]

    register_omni_plugin(Plugin(), "adopt", dist="omni-adopt")
    assert omni_plugin_manager.load_component("pipeline", "Narrow").supported_parallel == ("cfg",)
    assert DiffusersStepPipeline.supported_parallel == ("ulysses", "ring", "cfg")  # the base is left alone
    unnamed = omni_plugin_manager.load_component("attention", "UNNAMED")
    assert (unnamed.name, unnamed.requires) == ("UNNAMED", ("torch",))
    assert omni_plugin_manager.load_component("attention", "INHERITS").name == "INHERITS"
    assert TorchSDPABackend.name == "TORCH_SDPA"


def test_the_walk_answers_for_every_kind():
    """Platforms are probed as instances; pipelines, schedulers and executors have no probe and pass that step."""
    from omni_core.plugins.availability import check_component

    pm = create_plugin_manager(strict=True)
    assert check_component("platform", "cpu", pm=pm).ok
    assert check_component("scheduler", "step", pm=pm).ok and check_component("executor", "uni", pm=pm).ok
    assert check_component("pipeline", "ShapesPipeline", pm=pm).ok
    import torch

    cuda = check_component("platform", "cuda", pm=pm)
    if torch.version.cuda is None:  # a CPU build of torch (CI): the platform's own probe says why
        assert not cuda.ok and cuda.step == "is_available" and "without CUDA" in cuda.reason
