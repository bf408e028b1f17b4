#!/usr/bin/env bash
# Set up this repository on a fresh machine: .venv with the CPU build of torch (pinned, installed first),
# then omni-core and every plugin under plugins/<kind>/<name>/ (editable), the test tools (pytest, schemathesis;
# uv for scripts/check_dists.py; playwright and, when missing, the system's chromium for the playground's browser tests)
# and the runtime's libraries. Safe to re-run. PYTHON picks the interpreter (default python3, >= 3.10).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON="${PYTHON:-python3}"
TORCH="torch==2.13.0"  # the CPU build; named in every pip call so that nothing replaces it

if [ ! -x .venv/bin/python ]; then
    echo "install: creating .venv with $("$PYTHON" --version 2>&1)"
    "$PYTHON" -m venv .venv
fi
pip_install() { .venv/bin/python -m pip install --quiet --disable-pip-version-check "$@"; }

echo "install: $TORCH"
pip_install "$TORCH"

plugins=()  # every plugin folder, so plugins added later are installed with no edit here
names=()
for pyproject in plugins/*/*/pyproject.toml; do
    [ -e "$pyproject" ] || continue
    plugins+=(-e "$(dirname "$pyproject")")
    names+=("$(dirname "$pyproject")")
done
echo "install: omni-core and ${#names[@]} plugin(s): ${names[*]}"
pip_install "$TORCH" "setuptools>=64" -e . "${plugins[@]}" \
    pytest httpx openai schemathesis uv playwright \
    diffusers transformers accelerate safetensors pillow tqdm numpy cache-dit fastapi uvicorn imageio imageio-ffmpeg peft torchao gguf

# the playground's browser tests drive a system Chromium through playwright (never `playwright install`: no
# download at test time); installed here when missing and apt is usable (root, or sudo without a password)
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1 && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
        as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
        echo "install: chromium (apt-get; for the playground's browser tests)"
        as_root apt-get update -qq && as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
    else
        echo "install: no chromium and no usable apt-get: the playground's browser tests will be skipped" >&2
    fi
fi

.venv/bin/python - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} was installed instead of 2.13.0"
eps = sorted(ep.name for ep in md.entry_points(group="omni_core.plugins"))
print(f"install: done: torch {torch.__version__}, omni-core {md.version('omni-core')}, plugins: {', '.join(eps)}")
PY
