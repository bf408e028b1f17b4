"""The server and the Python entry points reach the engine only through its client interface
(``omni_core.engine.client``), checked on the source: imports (lazy ones included) and every
``<x>.engine.<member>`` they use. And the wave types sit in a module executors and schedulers share."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import omni_core
from omni_core.engine.client import EngineClient

CORE = Path(omni_core.__file__).parent
CLIENT = "omni_core.engine.client"
MEMBERS = {name for name in vars(EngineClient) if not name.startswith("_")}


def sources(package: str) -> list[Path]:
    files = sorted((CORE / package).rglob("*.py"))
    assert files, package
    return files


def imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """Every module an import statement names (``from a import b`` also names ``a.b``: it may be a module)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"line {node.lineno}: relative import"
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def test_the_client_interface_lists_what_front_ends_use():
    assert {"submit", "abort", "stats", "is_dead", "dead_reason", "close", "limits", "model_info",
            "prepare_request", "weight_call", "collective_rpc", "release_memory", "resume_memory"} == MEMBERS


@pytest.mark.parametrize("package", ["serve", "entrypoints"])
def test_front_ends_import_nothing_from_the_engine_but_its_client_module(package):
    bad = []
    for path in sources(package):
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            is_engine = module == "omni_core.engine" or module.startswith("omni_core.engine.")
            if is_engine and module != CLIENT and not module.startswith(CLIENT + "."):
                bad.append(f"{path.relative_to(CORE)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("package", ["serve", "entrypoints"])
def test_front_ends_use_only_client_members_of_their_engine(package):
    used, bad = set(), []
    for path in sources(package):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and (  # x.engine.<member> or engine.<member>
                    (isinstance(node.value, ast.Attribute) and node.value.attr == "engine")
                    or (isinstance(node.value, ast.Name) and node.value.id == "engine")):
                used.add(node.attr)
                if node.attr not in MEMBERS:
                    bad.append(f"{path.relative_to(CORE)}:{node.lineno} uses engine.{node.attr}")
    assert not bad, "\n".join(bad)
    assert used, f"omni_core/{package} never uses its engine: the check looks at the wrong thing"


@pytest.mark.parametrize("package", ["executor", "worker"])
def test_executors_and_workers_do_not_import_the_schedulers(package):
    bad = [f"{path.relative_to(CORE)}:{line} imports {module}"
           for path in sources(package)
           for line, module in imported_modules(ast.parse(path.read_text(), str(path)))
           if module == "omni_core.sched" or module.startswith("omni_core.sched.")]
    assert not bad, "\n".join(bad)


def test_the_sched_interface_no_longer_holds_the_wave_types():
    import omni_core.sched.interface as interface
    import omni_core.waves as waves

    assert not hasattr(interface, "DiffusionSchedulerOutput") and not hasattr(interface, "RunnerOutput")
    assert waves.DiffusionSchedulerOutput().is_empty and waves.RunnerOutput().outputs == {}
