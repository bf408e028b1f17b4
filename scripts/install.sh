#!/usr/bin/env bash
# Set up this repository on a fresh machine: .venv with the CPU build of torch (pinned, installed first),
# then omni-core and every plugin under plugins/<kind>/<name>/ (editable), the test tools (pytest, schemathesis;
# uv for scripts/check_dists.py; playwright and, when missing, the system's chromium for the playground's browser
# test, through apt-get) and the runtime's libraries. Safe to re-run. PYTHON picks the interpreter (default
# python3, >= 3.10). --no-browser (or OMNI_SKIP_CHROMIUM=1) skips Chromium: the browser tests are then skipped.
# Prints one line per stage, and how long each took (pip itself is kept quiet).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

for arg in "$@"; do
    case "$arg" in
        --no-browser) OMNI_SKIP_CHROMIUM=1 ;;
        -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install: unknown option $arg (known: --no-browser, --help)" >&2; exit 2 ;;
    esac
done

start=$SECONDS
stage_name=""
stage_start=$SECONDS
stage() {  # a line when a stage starts, and how long the previous one took
    if [ -n "$stage_name" ]; then echo "install:   ($stage_name took $((SECONDS - stage_start)) s)"; fi
    stage_name="$1"
    stage_start=$SECONDS
    echo "install: [$1] $2"
}

PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"  # the CPU build; named in every pip call so that nothing replaces it

if [ ! -x .venv/bin/python ]; then
    stage venv "creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

stage torch "$TORCH, the CPU build (a large download; about a minute on a fast link)"
pip_install "$TORCH"

plugins=()  # every plugin folder, so plugins added later are installed with no edit here
names=()
for pyproject in plugins/*/*/pyproject.toml; do
    [ -e "$pyproject" ] || continue
    plugins+=(-e "$(dirname "$pyproject")")
    names+=("$(dirname "$pyproject")")
done
stage packages "omni-core, ${#names[@]} plugin(s) (${names[*]}), the test tools and the libraries (diffusers, transformers, cache-dit, torchao, fastapi, playwright, ...): the longest step, several minutes"
# uv installs the rest: the same ~120 packages in ~15 s where pip took ~80 s (fresh venvs side by side, cold uv
# cache, 2026-12-07), building the ~20 editable folders at once. It keeps the torch just installed (it satisfies
# the pin) but reads no pip configuration (find-links, extra indexes): if it fails, pip does the step.
pip_install uv
packages=("$TORCH" "setuptools>=64" wheel -e . "${plugins[@]}" \
    pytest pytest-xdist httpx "openai>=3.60,<4" schemathesis uv playwright av \
    diffusers transformers accelerate safetensors pillow tqdm numpy cache-dit fastapi uvicorn imageio imageio-ffmpeg peft torchao gguf)
if ! .venv/bin/uv pip install --quiet --python .venv/bin/python "${packages[@]}"; then
    echo "install: uv could not install the packages (above); pip does it instead (a few minutes)" >&2
    pip_install "$TORCH" "setuptools>=64" wheel  # the build backend first: every editable folder builds against it
    pip_install --no-build-isolation "${packages[@]}"
fi

# the playground's browser tests drive a system Chromium through playwright (never `playwright install`: no
# download at test time); installed here through apt-get when missing and apt is usable (root, or sudo without a
# password), unless --no-browser / OMNI_SKIP_CHROMIUM=1
if [ "${OMNI_SKIP_CHROMIUM:-0}" = 1 ]; then
    echo "install: [chromium] skipped (--no-browser / OMNI_SKIP_CHROMIUM=1): the playground's browser tests will be skipped"
elif command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
    echo "install: [chromium] already installed ($(command -v chromium || command -v chromium-browser))"
elif command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
    as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
    stage chromium "installing the system's chromium with apt-get (for the playground's browser tests; skip it with --no-browser or OMNI_SKIP_CHROMIUM=1)"
    as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
else
    echo "install: [chromium] not installed (no chromium and no usable apt-get): the playground's browser tests will be skipped" >&2
fi

stage check "torch is the pinned build; the plugins' entry points"
.venv/bin/python - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} was installed instead of 2.13.0"
eps = sorted(ep.name for ep in md.entry_points(group="omni_core.plugins"))
print(f"install: done: torch {torch.__version__}, omni-core {md.version('omni-core')}, plugins: {', '.join(eps)}")
PY
echo "install: finished in $((SECONDS - start)) s"
