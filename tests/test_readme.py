"""README, CI and docs stay consistent: CI runs the README's commands, and relative links in docs resolve."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def readme_command(name: str) -> str:
    m = re.search(rf"<!-- readme-command: {name} -->\n```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert m, f"README.md has no '{name}' command block"
    return m.group(1).strip()


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    setup, test = readme_command("setup"), readme_command("test")
    install, main_job = setup.split(" && ")
    assert install in ci, f".ci/run does not run the README's install step {install!r}"
    # the main job runs with the same arguments (CI writes the image to a temp folder)
    assert main_job.split(" --out ")[0] in ci, f".ci/run does not run the README's main job {main_job!r}"
    assert f"\n{test}\n" in ci, f".ci/run does not run the README's test command {test!r}"
    assert "-eq 5" in ci  # pytest's "no tests collected" is a failure


def test_installer_pins_torch_and_globs_plugins():
    install = (ROOT / "scripts" / "install.sh").read_text()
    assert 'TORCH="torch==2.13.0"' in install and "plugins/*/*/pyproject.toml" in install
    assert install.index('pip_install "$TORCH"\n') < install.index("-e . ")  # torch first


DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        assert (doc.parent / target).exists(), f"{doc.relative_to(ROOT)} links to missing {target}"


def test_ci_checks_each_distribution_alone_before_the_tests():
    ci = (ROOT / ".ci" / "run").read_text()
    check = ".venv/bin/python scripts/check_dists.py \\\n    || {"
    assert check in ci and "exit 1; }" in ci[ci.index(check):ci.index(check) + 200]
    assert ci.index(check) < ci.index(f"\n{readme_command('test')}\n")  # pytest's summary stays the last line


def test_installer_and_test_extra_bring_schemathesis_and_uv():
    import tomllib

    install = (ROOT / "scripts" / "install.sh").read_text()
    line = install[install.index('-e . "${plugins[@]}"'):]
    line = line[:line.index("\n\n")]
    test_extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    for tool in ("schemathesis", "uv"):
        assert f" {tool} " in line, f"scripts/install.sh does not install {tool}"
        assert tool in test_extra, f"omni-core's test extra lacks {tool}"


def test_installer_says_what_it_does_and_chromium_can_be_skipped():
    """scripts/install.sh prints a line per stage, says that it installs Chromium through apt-get, and skips it on
    --no-browser / OMNI_SKIP_CHROMIUM=1, as the README says; CI installs it (the playground's browser tests)."""
    import subprocess

    install = (ROOT / "scripts" / "install.sh").read_text()
    for stage in ("stage torch ", "stage packages ", "stage chromium ", "stage check "):
        assert stage in install, f"scripts/install.sh announces no {stage.split()[1]!r} stage"
    assert "apt-get" in install[install.index("stage chromium "):][:200]
    assert '--no-browser) OMNI_SKIP_CHROMIUM=1' in install and 'if [ "${OMNI_SKIP_CHROMIUM:-0}" = 1 ]' in install
    readme = (ROOT / "README.md").read_text()
    assert "Chromium through `apt-get`" in readme and "--no-browser" in readme and "OMNI_SKIP_CHROMIUM=1" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/install.sh ||" in ci and "OMNI_SKIP_CHROMIUM" not in ci  # CI runs the browser tests
    bad = subprocess.run(["bash", str(ROOT / "scripts" / "install.sh"), "--bogus"], capture_output=True, text=True,
                         timeout=30)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr  # refused before anything is installed
