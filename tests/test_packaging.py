"""Every distribution declares what it imports, and scripts/check_dists.py covers every distribution.

The real check is scripts/check_dists.py (CI runs it: each wheel installed alone, its tests run there). This is
its fast static counterpart for the main suite: the top-level imports of each distribution's sources and tests,
mapped to distributions through this environment's metadata, must be declared by its pyproject.toml.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import importlib.util
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("check_dists", ROOT / "scripts" / "check_dists.py")
check_dists = importlib.util.module_from_spec(spec)
spec.loader.exec_module(check_dists)
DISTS = check_dists.distributions()

#: optional imports that are guarded on purpose (import name per distribution, with why)
OPTIONAL = {
    ("omni-cache-teacache", "omni_model_shapes"): "only when calibrating the shapes model, which is then installed",
}


def imports(folder: Path) -> set[str]:
    """Top-level names imported by the .py files under ``folder``; a name a file reaches through
    ``pytest.importorskip`` is optional in that file."""
    names = set()
    for path in folder.rglob("*.py"):
        if "fixtures" in path.parts:
            continue  # throwaway distributions of their own
        found, skipped = set(), set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                skipped.add(node.args[0].value.split(".")[0])
        names |= found - skipped
    return names - set(sys.stdlib_module_names) - {"__future__"}


def declared(project: dict, extras: tuple[str, ...]) -> set[str]:
    reqs = list(project.get("dependencies", []))
    for extra in extras:
        reqs += project.get("optional-dependencies", {}).get(extra, [])
    return {canonicalize_name(Requirement(r).name) for r in reqs} | {canonicalize_name(project["name"])}


def undeclared(name: str, folder: Path, part: str, extras: tuple[str, ...]) -> list[str]:
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    ok = declared(project, extras)
    by_module = md.packages_distributions()
    missing = []
    for module in sorted(imports(folder / part)):
        dists = {canonicalize_name(d) for d in by_module.get(module, [])}
        if not dists or (name, module) in OPTIONAL:
            continue  # not installed here (a GPU-only kernel, guarded) or optional on purpose
        if not dists & ok:
            missing.append(f"{module} (from {', '.join(sorted(dists))})")
    return missing


def test_check_dists_covers_every_distribution():
    found = {str(f.relative_to(ROOT)) for _, f in DISTS}
    pyprojects = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("plugins/*/*/pyproject.toml")}
    assert found == pyprojects | {".", "docs/examples/omni-attention-toy", "docs/examples/omni-model-toy",
                                  "docs/examples/omni-cache-toy", "docs/examples/omni-executor-toy",
                                  "docs/examples/omni-model-pixart"}
    assert len({n for n, _ in DISTS}) == len(DISTS)


@pytest.mark.parametrize("name, folder", DISTS, ids=[n for n, _ in DISTS])
def test_runtime_imports_are_declared(name, folder):
    if folder == ROOT:  # the core imports its runtime libraries lazily; any extra may provide them
        extras = tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
        missing = undeclared(name, folder, "omni_core", extras)
    else:
        missing = undeclared(name, folder, "src", ())
    assert not missing, f"{name} imports but does not declare: {missing}"


@pytest.mark.parametrize("name, folder", [d for d in DISTS if d[1] != ROOT], ids=[n for n, f in DISTS if f != ROOT])
def test_test_imports_are_declared_in_the_test_extra(name, folder):
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    assert "test" in project.get("optional-dependencies", {}), f"{name} has no test extra"
    missing = undeclared(name, folder, "tests", ("test",))
    assert not missing, f"{name}'s tests import but its test extra does not declare: {missing}"


def test_the_audit_finds_an_undeclared_import(tmp_path):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    (tmp_path / "src" / "pkg" / "m.py").write_text("import accelerate\nimport torch\n")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "omni-x"\ndependencies = ["torch"]\n')
    assert undeclared("omni-x", tmp_path, "src", ()) == ["accelerate (from accelerate)"]


def _wheel(folder: Path, name: str, *requires: str) -> Path:
    """A wheel holding only its METADATA: what check_dists reads to find the local dependencies."""
    import zipfile

    path = folder / f"{name.replace('-', '_')}-0.1.0-py3-none-any.whl"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name.replace('-', '_')}-0.1.0.dist-info/METADATA", f"Name: {name}\n{meta}")
    return path


def test_local_requirements_follow_extras_transitively(tmp_path):
    wheels = {
        "omni-core": _wheel(tmp_path, "omni-core", "pluggy", "torch>=2.4; extra == 'runtime'"),
        "omni-attention-sdpa": _wheel(tmp_path, "omni-attention-sdpa", "omni-core>=0.1,<0.2", "torch>=2.4"),
        "omni-model-x": _wheel(tmp_path, "omni-model-x", "omni-core[runtime]>=0.1,<0.2", "diffusers",
                               "omni-platform-npu; extra == 'test'"),
        "omni-platform-npu": _wheel(tmp_path, "omni-platform-npu", "omni-core[video]"),
    }
    needs = check_dists.local_requirements
    assert needs("omni-model-x", set(), wheels) == {"omni-core": {"runtime"}}
    assert needs("omni-model-x", {"test"}, wheels) == {"omni-core": {"runtime", "video"}, "omni-platform-npu": set()}
    assert needs("omni-attention-sdpa", {"test"}, wheels) == {"omni-core": set()}


def test_torch_comes_from_the_local_cpu_wheel_when_there_is_one(tmp_path):
    assert check_dists.torch_requirement([str(tmp_path)]) == "torch==2.13.0"  # none here: the plain pin
    (tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert check_dists.torch_requirement([str(tmp_path)]) == "torch==2.13.0+cpu"  # no index has this build
