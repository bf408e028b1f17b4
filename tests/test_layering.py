"""Imports against the layering, read from the source (pure AST): the server does not reach into the pipelines
for image conversion, cache and model plugins do not reach into the worker, and the core names no attention
kernel in code (the platforms' default comes from the installed backends' records)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``path``, lazy ones included; ``from m import x`` gives ``m.x``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return out


def offenders(files, refused: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line}: {name}" for path in files for line, name in imported_modules(path)
            if name.startswith(refused)]


def test_the_server_converts_images_without_the_pipelines():
    found = offenders(sorted((REPO / "omni_core" / "serve").rglob("*.py")), ("omni_core.pipelines",))
    assert not found, f"the server imports the pipelines (omni_core.images holds the conversions): {found}"


def test_cache_and_model_plugins_do_not_import_the_worker():
    files = sorted(p for kind in ("cache", "models") for p in (REPO / "plugins" / kind).glob("*/src/**/*.py"))
    assert files
    found = offenders(files, ("omni_core.worker", "omni_core.engine"))
    assert not found, f"plugins import the engine's internals (public homes: omni_core.utils, ...): {found}"


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants that are neither docstrings nor an argparse ``help=``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                skip.add(id(first.value))
        if isinstance(node, ast.keyword) and node.arg == "help":
            skip.update(id(n) for n in ast.walk(node.value))
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip]


def test_the_core_names_no_attention_kernel_in_code():
    kernels = ("TORCH_SDPA", "FLASH_ATTN", "SAGE_ATTN")
    found = [f"{path.relative_to(REPO)}:{line}" for path in sorted((REPO / "omni_core").rglob("*.py"))
             for line, text in _code_strings(path) if any(k in text for k in kernels)]
    assert not found, f"the core names an attention kernel (records decide the default): {found}"


def test_the_core_names_no_plugin_in_its_combination_rules():
    """Which features a cache backend cannot run with is its record's to say (``CacheBackendSpec.refuses``): the
    core's table of combinations names no component of any installed plugin."""
    from omni_core.plugins.manager import get_plugin_manager

    pm = get_plugin_manager()
    names = {name for kind in ("cache", "attention", "executor", "pipeline") for name, rec in pm.components(kind).items()
             if getattr(rec, "provider", "") not in ("", "omni-core")}
    assert {"tea_cache", "cache_dit"} <= names  # the check reads the plugins it means to
    text = (REPO / "omni_core" / "combinations.py").read_text(encoding="utf-8")
    named = sorted(n for n in names if n in text)
    assert not named, f"omni_core/combinations.py names plugin components: {named}"
