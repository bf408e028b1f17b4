"""Layering of ``omni_core`` read from the source (pure AST, nothing imported): no two modules import each
other, directly or through a chain; packages import only down the layers listed in ``docs/architecture.md``; and
no module imports another package's private names.

Every import counts, module-level or inside a function (a lazy import is still a dependency), and for the cycles
and the layers also those under ``if TYPE_CHECKING:`` (a type-only import is still a dependency of the design).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "omni_core"
#: third-party libraries whose private names (``_x``) the core must not import
LIBRARIES = ("torch", "diffusers", "transformers")


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the package at ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(module: str, path: Path, type_only: bool = True) -> list[tuple[int, str, list[str]]]:
    """``(line, imported module, names)`` of every import (``type_only=False``: of every import that runs);
    relative imports are resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = set() if type_only else _type_checking_nodes(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            out.append((node.lineno, target, [alias.name for alias in node.names]))
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (``from m import x`` names ``m.x`` when that is a module)."""
    files = module_files(root)

    def known(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        edges = set()
        for _, target, names in imports(module, path):
            for name in [target, *(f"{target}.{n}" for n in names)]:
                found = known(name)
                if found is not None and found != module:
                    edges.add(found)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_imports(root: Path) -> list[str]:
    """``file:line: module imports name`` for each private name taken from outside the importer's package.

    A private name (``_x``) belongs to the package that holds it (the package of the module that defines it,
    or the package itself for a private submodule); only modules of that same package may import it. Private
    names of torch, diffusers and transformers are never imported.
    """
    top = root.name
    files = module_files(root)

    def refused(name: str, package: str) -> bool:
        parts = name.split(".")
        first = next((i for i, part in enumerate(parts) if _private(part)), None)
        if first is None:
            return False
        if parts[0] != top:
            return parts[0] in LIBRARIES
        owner = ".".join(parts[:first])
        if owner in files and files[owner].name != "__init__.py":
            owner = owner.rpartition(".")[0]
        return owner != package

    out = []
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, target, names in imports(module, path):
            bad = [target] if refused(target, package) else [
                f"{target}.{name}" for name in names if refused(f"{target}.{name}", package)]
            out.extend(f"{path.relative_to(root.parent).as_posix()}:{line}: {module} imports {name}" for name in bad)
    return sorted(out)


# ---------------------------------------------------------------------- the checkers themselves
def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path / "pkg"


def test_checker_finds_direct_lazy_and_chained_cycles(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import x\n",
        "b.py": "def f():\n    from pkg import c\n",  # lazy, through the package
        "c.py": "import pkg.a\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.e import E\n",
        "e.py": "from . import d\n",
    })
    assert cycles(import_graph(root)) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]  # type-only counts


def test_checker_finds_private_imports_across_packages(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub._impl import thing\n",  # its own private module: fine
        "sub/_impl.py": "thing = 1\n",
        "sub/user.py": "from pkg.sub._impl import thing\nfrom ._impl import thing as t\n",  # same package
        "other.py": "from pkg.sub.user import _helper\n",
        "lazy.py": "def f():\n    from pkg.sub import _impl\n",
        "lib.py": "from torch._dynamo import config\nimport diffusers.models._modeling_parallel\n",
    })
    assert private_imports(root) == [
        "pkg/lazy.py:2: pkg.lazy imports pkg.sub._impl",
        "pkg/lib.py:1: pkg.lib imports torch._dynamo",
        "pkg/lib.py:2: pkg.lib imports diffusers.models._modeling_parallel",
        "pkg/other.py:1: pkg.other imports pkg.sub.user._helper",
    ]


ARCHITECTURE = ROOT.parent / "docs" / "architecture.md"


def declared_layers(text: str) -> dict[str, int]:
    """Package -> its layer (1 = top) from the numbered list after ``<!-- layers -->`` in the architecture doc."""
    block = text.split("<!-- layers -->", 1)[1].split("\n\n", 2)[1]
    out = {}
    for line in block.splitlines():
        number, _, rest = line.partition(". ")
        for name in re.findall(r"`([a-z_]+)`", rest):
            out[name] = int(number)
    return out


def upward_imports(root: Path, layers: dict[str, int]) -> list[str]:
    """``importer -> imported (layer i -> j)`` for each import from a package to one in a higher layer (type-only
    included); the package root's own ``__init__`` (lazy re-exports) is no layer."""
    top = root.name
    graph = import_graph(root)

    def package(module: str) -> str | None:
        parts = module.split(".")
        return parts[1] if len(parts) > 1 else None

    found = []
    for module, targets in sorted(graph.items()):
        a = package(module)
        for target in sorted(targets):
            b = package(target)
            if a is None or b is None or a == b:
                continue
            if a not in layers or b not in layers:
                found.append(f"{module} -> {target}: package {a if a not in layers else b!r} is in no layer of "
                             f"the architecture doc")
            elif layers[b] < layers[a]:
                found.append(f"{module} -> {target} (layer {layers[a]} -> {layers[b]})")
    return [f for f in found if not f.startswith(f"{top} ")]


def test_checker_finds_imports_up_the_layers(tmp_path):
    root = _tree(tmp_path, {
        "__init__.py": "",
        "high/__init__.py": "from pkg.low import thing\n",
        "low/__init__.py": "thing = 1\n",
        "low/user.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import x\n",
        "loose/__init__.py": "",
        "low/more.py": "from pkg import loose\n",
    })
    assert upward_imports(root, {"high": 1, "low": 2}) == [
        "pkg.low.more -> pkg.loose: package 'loose' is in no layer of the architecture doc",
        "pkg.low.user -> pkg.high (layer 2 -> 1)",
    ]


# ---------------------------------------------------------------------- omni_core
def test_packages_import_only_down_the_architecture_docs_layers():
    layers = declared_layers(ARCHITECTURE.read_text(encoding="utf-8"))
    packages = {p.name if p.is_dir() else p.stem for p in ROOT.iterdir()
                if (p.is_dir() and (p / "__init__.py").exists()) or (p.suffix == ".py" and p.stem != "__init__")}
    assert packages <= set(layers), f"packages the doc's layers do not place: {sorted(packages - set(layers))}"
    found = upward_imports(ROOT, layers)
    assert not found, f"imports up the layers of docs/architecture.md: {found}"


def test_no_import_cycle_in_omni_core():
    found = cycles(import_graph(ROOT))
    assert not found, f"modules importing each other (directly or through a chain): {found}"


def test_no_private_imports_across_packages():
    found = private_imports(ROOT)
    assert not found, "private names imported from outside the importer's package:\n" + "\n".join(found)


#: the most lines a module of the core or of a first-party plugin may have: past it, it holds more than one concept
MAX_MODULE_LINES = 450


def test_no_module_is_over_the_line_limit():
    files = [*ROOT.rglob("*.py"), *ROOT.parent.glob("plugins/*/*/src/**/*.py")]
    long = {str(p.relative_to(ROOT.parent)): n for p in files if (n := len(p.read_text(encoding="utf-8").splitlines()))
            > MAX_MODULE_LINES}
    assert not long, f"modules over {MAX_MODULE_LINES} lines (split them by concept): {long}"
