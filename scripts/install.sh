#!/usr/bin/env bash
# Set up this repository on a fresh machine: .venv with the CPU build of torch (pinned, installed first),
# then omni-core and every plugin under plugins/<kind>/<name>/ (editable), the test tools (pytest, schemathesis;
# uv for scripts/check_dists.py) and the runtime's libraries. Safe to re-run. PYTHON picks the interpreter (default python3, >= 3.10).
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
    pytest httpx openai schemathesis uv \
    diffusers transformers accelerate safetensors pillow tqdm numpy cache-dit fastapi uvicorn imageio imageio-ffmpeg torchao gguf

.venv/bin/python - <<'PY'
import importlib.metadata as md
import torch
assert torch.__version__.split("+")[0] == "2.13.0", f"torch {torch.__version__} was installed instead of 2.13.0"
eps = sorted(ep.name for ep in md.entry_points(group="omni_core.plugins"))
print(f"install: done: torch {torch.__version__}, omni-core {md.version('omni-core')}, plugins: {', '.join(eps)}")
PY
