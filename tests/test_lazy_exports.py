"""``omni_core.utils.lazy``: the one lazy-export mechanism of the core's packages."""

from __future__ import annotations

import importlib
import sys
import types

import pytest

from omni_core.utils.lazy import lazy_dir, lazy_exports

PACKAGES = ("omni_core", "omni_core.attention.parallel", "omni_core.distributed", "omni_core.serve")


@pytest.fixture
def module():
    mod = types.ModuleType("omni_lazy_probe")
    mod._LAZY = {"dumps": "json:dumps", "Path": "pathlib:Path"}
    mod.__getattr__ = lazy_exports(mod.__name__, mod._LAZY)
    mod.__dir__ = lazy_dir(mod.__name__, mod._LAZY)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def test_resolves_on_first_access_and_caches_in_the_module(module):
    import json

    assert "dumps" not in vars(module)
    assert module.dumps is json.dumps
    assert vars(module)["dumps"] is json.dumps  # later accesses skip __getattr__


def test_unknown_name_is_the_usual_attribute_error(module):
    with pytest.raises(AttributeError, match="^module 'omni_lazy_probe' has no attribute 'nope'$"):
        module.nope
    assert not hasattr(module, "nope")


def test_dir_lists_lazy_and_loaded_names(module):
    assert {"dumps", "Path", "_LAZY", "__getattr__"} <= set(dir(module))
    assert dir(module) == sorted(dir(module))


@pytest.mark.parametrize("package", PACKAGES)
def test_every_export_of_the_core_packages_resolves(package):
    mod = importlib.import_module(package)
    for name, target in mod._LAZY.items():
        value = getattr(mod, name)
        assert value is getattr(importlib.import_module(target.split(":")[0]), target.split(":")[1])
        assert name in mod.__all__
    with pytest.raises(AttributeError, match=f"^module {package!r} has no attribute 'no_such_name'$"):
        getattr(mod, "no_such_name")
