#!/usr/bin/env python3
"""Install every distribution alone and run its own tests against the installed wheel.

A dependency that a distribution imports but does not declare goes unnoticed in the project's ``.venv``
(``scripts/install.sh`` installs everything). Here each distribution gets a fresh virtual environment
holding only its wheel, what that wheel declares (its ``test`` extra included) and the pinned torch, and its
tests run from a copy outside the repository, so the source tree cannot be imported.

Steps: build every wheel once (``uv build`` from a copy of the sources, so nothing is written into the
tree), then per distribution, two at a time: ``uv venv``, ``uv pip install`` (a shared package cache makes
repeat runs fast; torch comes from the local CPU wheel in ``--find-links``, never from an index), a check
that the installed packages are the ones imported, the core's ``omni`` commands, and pytest.

    .venv/bin/python scripts/check_dists.py                  # all distributions
    .venv/bin/python scripts/check_dists.py omni-model-wan   # some of them (names or folders)
    .venv/bin/python scripts/check_dists.py -m ''            # the slow tests too (CI: -m 'not slow')

Prints one line per distribution as each finishes (pass/fail, install and test seconds, pytest's summary; ``--jobs``
of them at once, default 2) and exits 1 if any failed. ``--keep`` leaves the work folder (venvs, test copies, logs) for inspection.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"
#: root test files that need no plugin (the others select TORCH_SDPA or load a model plugin), run against the
#: core wheel with all its extras: import cost, hook specs vs their generated reference, platform resolution
CORE_TESTS = ("test_import_light.py", "test_hookspecs.py", "test_platforms.py")
#: repository files those tests read: their conftest and the throwaway plugin distributions it installs, the
#: hook reference and its generator (none of them is the core's source)
CORE_TEST_FILES = ("tests/conftest.py", "tests/fixtures", "docs/plugins/hooks.md", "scripts/gen_hook_docs.py")
#: extra folders holding a distribution (besides the core and plugins/<kind>/<name>)
EXTRA_DISTS = ("docs/examples/omni-attention-toy", "docs/examples/omni-model-toy", "docs/examples/omni-cache-toy",
               "docs/examples/omni-executor-toy", "docs/examples/omni-model-pixart")


def distributions() -> list[tuple[str, Path]]:
    """(name, folder) of the core, every plugin and the guide's example package."""
    folders = [ROOT] + sorted(Path(p).parent for p in glob.glob(str(ROOT / "plugins/*/*/pyproject.toml")))
    folders += [ROOT / d for d in EXTRA_DISTS]
    return [(tomllib.loads((f / "pyproject.toml").read_text())["project"]["name"], f) for f in folders]


def find_uv() -> str:
    here = Path(sys.executable).parent / "uv"
    found = str(here) if here.exists() else shutil.which("uv")
    if not found:
        sys.exit("check_dists: uv not found; install it: python -m pip install uv (scripts/install.sh does)")
    return found


def find_links() -> list[str]:
    """pip's find-links (``PIP_FIND_LINKS``, default /opt/wheels where the local CPU torch wheel lives)."""
    dirs = os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()
    return [d for d in dirs if os.path.isdir(d)]


def torch_requirement(links: list[str]) -> str:
    """The exact local CPU build when one is there, so the resolver cannot pick a CUDA wheel from an index."""
    for d in links:
        for wheel in sorted(Path(d).glob(f"torch-{TORCH_VERSION}+cpu-*.whl")):
            return f"torch=={wheel.name.split('-')[1]}"
    return f"torch=={TORCH_VERSION}"


def run(cmd: list[str], log: Path, **kw) -> int:
    """Run ``cmd``, appending its output to ``log``; the exit code."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n")
        out.flush()
        return subprocess.run([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT, **kw).returncode


def build_wheels(uv: str, dists: list[tuple[str, Path]], work: Path) -> dict[str, Path]:
    """One wheel per distribution, built from a copy of its sources (no build/ or egg-info in the tree), two at
    a time (the machine has two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    def build(name: str, folder: Path) -> Path:
        src, out = work / "src" / name, work / "wheels" / name
        if folder == ROOT:  # the core: its package and the files pyproject.toml names, not the whole repo
            src.mkdir(parents=True)
            for item in ("pyproject.toml", "README.md"):
                shutil.copy2(ROOT / item, src / item)
            shutil.copytree(ROOT / "omni_core", src / "omni_core", ignore=_IGNORE)
        else:
            shutil.copytree(folder, src, ignore=shutil.ignore_patterns("tests", *_JUNK))
        log = work / "logs" / f"build-{name}.log"
        if run([uv, "build", "--wheel", "--quiet", "--out-dir", out, src], log) != 0:
            raise SystemExit(f"check_dists: building the wheel of {name} failed; see {log}")
        (wheel,) = out.glob("*.whl")
        return wheel

    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(build, name, folder) for name, folder in dists}
        return {name: future.result() for name, future in futures.items()}


_JUNK = ("build", "dist", "*.egg-info", "__pycache__", "*.pyc")
_IGNORE = shutil.ignore_patterns(*_JUNK)


def local_requirements(name: str, extras: set[str], wheels: dict[str, Path]) -> dict[str, set[str]]:
    """The repository's own distributions that ``name[extras]`` needs, transitively (from wheel metadata):
    they are installed from the wheels just built, everything else from the index."""
    import zipfile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    local = {canonicalize_name(n): n for n in wheels}
    needed: dict[str, set[str]] = {}
    todo = [(name, extras)]
    while todo:
        dist, want = todo.pop()
        with zipfile.ZipFile(wheels[dist]) as zf:
            meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
            lines = zf.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            dep = local.get(canonicalize_name(req.name))
            active = req.marker is None or any(req.marker.evaluate({"extra": e}) for e in want | {""})
            if dep is None or not active:
                continue
            new = set(req.extras) - needed.get(dep, set())
            if dep not in needed or new:
                needed.setdefault(dep, set()).update(req.extras)
                todo.append((dep, needed[dep]))
    needed.pop(name, None)
    return needed


def _spec(name: str, extras: set[str], wheel: Path) -> str:
    return f"{name}[{','.join(sorted(extras))}] @ {wheel.as_uri()}" if extras else f"{name} @ {wheel.as_uri()}"


def check(name: str, folder: Path, wheels: dict[str, Path], uv: str, work: Path, links: list[str],
          torch_req: str, markers: str = "not slow") -> dict:
    """Install ``name`` alone into a fresh venv and run its tests there; a result row."""
    log = work / "logs" / f"{name}.log"
    venv, tests_root = work / "venvs" / name, work / "run" / name
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "OMNI_"))}
    env.update(HF_HUB_OFFLINE="1", VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    row = {"name": name, "ok": False, "install_s": 0.0, "test_s": 0.0, "summary": "", "log": log}

    t0 = time.monotonic()
    # the core with every extra it has (its tests cover the runtime and the server); a plugin with its test extra
    project = tomllib.loads((folder / "pyproject.toml").read_text())["project"]
    extras = set(project.get("optional-dependencies", {})) if folder == ROOT else {"test"}
    reqs = [_spec(name, extras, wheels[name]), torch_req]
    reqs += [_spec(dep, ex, wheels[dep]) for dep, ex in sorted(local_requirements(name, extras, wheels).items())]
    install = [uv, "pip", "install", "--python", python, "--quiet", *[f"--find-links={d}" for d in links], *reqs]
    if run([uv, "venv", "--quiet", "--python", sys.executable, venv], log) != 0 or run(install, log, env=env) != 0:
        row["summary"] = "install failed"
        return row
    row["install_s"] = time.monotonic() - t0

    t0 = time.monotonic()
    # the tests, copied where no repository source is importable (cwd is the copy; PYTHONPATH is cleared)
    tests = tests_root / "tests"
    if folder == ROOT:
        for rel in CORE_TEST_FILES + tuple(f"tests/{test}" for test in CORE_TESTS):
            (tests_root / rel).parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / rel).is_dir():
                shutil.copytree(ROOT / rel, tests_root / rel, ignore=_IGNORE)
            else:
                shutil.copy2(ROOT / rel, tests_root / rel)
    else:
        shutil.copytree(folder / "tests", tests, ignore=_IGNORE)
    (tests_root / "pytest.ini").write_text(
        "[pytest]\naddopts = --import-mode=importlib -p no:cacheprovider\nnorecursedirs = fixtures\n")
    entry_points = project.get("entry-points", {}).get("omni_core.plugins", {})
    modules = ["omni_core"] + [v.split(":")[0].split(".")[0] for v in entry_points.values()]
    where = ("import sys, importlib; ms = [importlib.import_module(m) for m in sys.argv[1:]];"
             "bad = [m.__file__ for m in ms if not m.__file__.startswith(sys.prefix)];"
             "sys.exit(f'imported from outside the venv: {bad}' if bad else 0)")
    steps = [[python, "-c", where, *modules]]
    if folder == ROOT:
        steps += [[venv / "bin" / "omni", "plugins", "list", "--all"], [venv / "bin" / "omni", "env"]]
    for step in steps:
        if run(step, log, env=env, cwd=tests_root) != 0:
            row["summary"] = f"{Path(str(step[0])).name} {' '.join(map(str, step[1:2]))} failed"
            row["test_s"] = time.monotonic() - t0
            return row
    rc = run([python, "-m", "pytest", "-q", *(["-m", markers] if markers else []), "tests"], log, env=env,
             cwd=tests_root)
    row["test_s"] = time.monotonic() - t0
    tail = [ln for ln in log.read_text().splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    row["summary"] = tail[-1].strip("= ") if tail else f"pytest exit {rc}"
    row["ok"] = rc == 0
    return row



#: the distributions whose tests take longest (seconds on the 2-core CI machine, 2026-12-06: executor-ray 148,
#: model-diffusers 102, model-shapes 97; the rest 1-40): started first, so ``--jobs`` workers end together instead of
#: one of them starting a long one last (366-380 s in listed order; the longest-first order packs the same work)
LONGEST = ("omni-executor-ray", "omni-model-diffusers", "omni-model-hunyuan-video15", "omni-model-ltx2",
           "omni-model-flux2", "omni-model-qwen-image21", "omni-model-shapes", "omni-cache-dit", "omni-model-qwen-image",
           "omni-cache-teacache")


def longest_first(dists: list) -> list:
    """``dists`` with the known long ones first (in :data:`LONGEST` order), the rest as listed."""
    rank = {name: i for i, name in enumerate(LONGEST)}
    return sorted(dists, key=lambda d: rank.get(d[0], len(LONGEST)))

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("only", nargs="*", help="distribution names or folders to check (default: all)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (venvs, test copies, logs)")
    parser.add_argument("-m", dest="markers", default="not slow",
                        help="pytest marker expression for every distribution's tests (default: 'not slow', as "
                             "CI; '' runs them all)")
    parser.add_argument("-j", "--jobs", type=int, default=2,
                        help="distributions checked at once (default 2: the machine's cores)")
    args = parser.parse_args(argv)

    dists = distributions()
    if args.only:
        wanted = {o.rstrip("/") for o in args.only}
        unknown = wanted - {n for n, _ in dists} - {str(f.relative_to(ROOT)) for _, f in dists}
        if unknown:
            parser.error(f"unknown distribution(s) {sorted(unknown)}; known: {', '.join(n for n, _ in dists)}")
        chosen = [(n, f) for n, f in dists if n in wanted or str(f.relative_to(ROOT)) in wanted]
    else:
        chosen = dists
    uv, links = find_uv(), find_links()
    torch_req = torch_requirement(links)
    work = Path(tempfile.mkdtemp(prefix="omni-check-dists-"))
    (work / "logs").mkdir()
    print(f"check_dists: {len(chosen)} distribution(s); {torch_req}; find-links {links or 'none'}; work {work}",
          flush=True)
    t0 = time.monotonic()
    try:
        wheels = build_wheels(uv, dists, work)  # every wheel: the local dependencies come from them
        print(f"check_dists: built {len(wheels)} wheels in {time.monotonic() - t0:.0f} s", flush=True)
        rows = []

        def one(name: str, folder: Path) -> dict:
            row = check(name, folder, wheels, uv, work, links, torch_req, args.markers)
            if not args.keep:
                shutil.rmtree(work / "venvs" / name, ignore_errors=True)
            return row

        from concurrent.futures import ThreadPoolExecutor, as_completed

        # each distribution in its own venv and folder: independent, so ``--jobs`` of them at once (the install is
        # mostly waiting on disk and the resolver, the tests on one core each)
        with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for future in as_completed([pool.submit(one, name, folder) for name, folder in longest_first(chosen)]):
                row = future.result()
                rows.append(row)
                print(f"  {'PASS' if row['ok'] else 'FAIL'}  {row['name']:<24} install {row['install_s']:5.1f} s  "
                      f"tests {row['test_s']:6.1f} s  {row['summary']}", flush=True)
                if not row["ok"]:
                    print("\n".join("    | " + ln for ln in row["log"].read_text().splitlines()[-40:]), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [r["name"] for r in rows if not r["ok"]]
    print(f"check_dists: {len(rows) - len(failed)} passed, {len(failed)} failed "
          f"in {time.monotonic() - t0:.0f} s" + (f": {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
