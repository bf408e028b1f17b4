"""Every hook spec documents its parameters, return value, when and in which process it is called, and an example."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from omni_core.plugins import hookspecs

DOCS = Path(__file__).resolve().parents[1] / "docs"
SPECS = sorted(name for name, fn in vars(hookspecs).items()
               if inspect.isfunction(fn) and hasattr(fn, "omni_spec"))


def test_specs_found():
    assert "omni_register_attention_backends" in SPECS and "omni_register_commands" in SPECS
    assert all(name.startswith("omni_") for name in SPECS)


@pytest.mark.parametrize("name", SPECS)
def test_spec_docstring_is_complete(name):
    fn = getattr(hookspecs, name)
    doc = inspect.getdoc(fn) or ""
    problems = []
    params = list(inspect.signature(fn).parameters)
    if params:
        problems += [f"no ':param {p}:'" for p in params if f":param {p}:" not in doc]
    elif "Takes no arguments." not in doc:
        problems.append("no 'Takes no arguments.' (say so when there are no parameters)")
    if ":returns:" not in doc:
        problems.append("no ':returns:'")
    if fn.omni_spec.get("firstresult") and "first non-None" not in doc:
        problems.append("firstresult hook must say it stops at the first non-None result")
    called = re.search(r"\*\*Called:\*\*(.*?)(?:\n\n|$)", doc, re.S)
    if not called:
        problems.append("no '**Called:**' paragraph")
    elif "process" not in called.group(1):
        problems.append("the '**Called:**' paragraph does not say in which process")
    example = re.search(r"Example::\n\n((?:    .*\n?)+)", doc)
    if not example:
        problems.append("no indented 'Example::' block")
    elif "@hookimpl" not in example.group(1) or f"def {name}(" not in example.group(1):
        problems.append("the example must show an @hookimpl implementing this hook")
    assert not problems, f"{name}: " + "; ".join(problems)


def test_missing_docs_are_detected(monkeypatch):
    """The check above can fail: a spec without the sections is reported."""
    def omni_fake(x):
        """Summary only."""

    monkeypatch.setattr(hookspecs, "omni_fake", hookspecs.hookspec(omni_fake), raising=False)
    with pytest.raises(AssertionError, match="no ':param x:'.*no ':returns:'.*no '\\*\\*Called:\\*\\*'"):
        test_spec_docstring_is_complete("omni_fake")


@pytest.mark.parametrize("name", SPECS)
def test_every_hook_is_in_the_reference_docs(name):
    assert name in (DOCS / "plugins" / "hooks.md").read_text(), f"{name} is missing from docs/plugins/hooks.md"


def test_hook_reference_is_generated_from_the_docstrings():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "scripts" / "gen_hook_docs.py"
    spec = importlib.util.spec_from_file_location("gen_hook_docs", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (DOCS / "plugins" / "hooks.md").read_text() == gen.render(), (
        "docs/plugins/hooks.md is out of date: run .venv/bin/python scripts/gen_hook_docs.py")


@pytest.mark.parametrize("name", SPECS)
def test_examples_name_first_party_code_that_exists(name):
    """A ``"module:attr"`` in an example that names a first-party package must resolve (without importing)."""
    import importlib.util

    doc = inspect.getdoc(getattr(hookspecs, name)) or ""
    for module, attr in re.findall(r'"(omni_[\w.]+):(\w+)"', doc):
        spec = importlib.util.find_spec(module.split(".")[0])
        if spec is None:  # that plugin is not installed here
            continue
        source = importlib.util.find_spec(module)
        assert source is not None and source.origin, f"{name}: example names {module!r}, which does not exist"
        assert re.search(rf"^(def|class) {attr}\b|^{attr} =", Path(source.origin).read_text(), re.M), (
            f"{name}: example names {module}:{attr}, which {module} does not define")
