#!/usr/bin/env bash
# One GPU check of Omni (issue #36): on one H200 in at most 8 minutes, from a copy of the working tree plus the
# wheels below, it runs the gpu-marked tests, the attention contracts on cuda, a probe of each GPU defect fixed
# in issue #36 (no CUDA context in the engine's process, host outputs, peak memory per request, the kernels'
# architecture rules), and a benchmark of the Qwen-Image transformer at its published configuration with random
# bf16 weights (1024x1024, 20 steps; diffusers' attention against Omni's with TORCH_SDPA and each installed faster
# kernel). It writes one results file, $OUT/gpu_check.json (section by section; a failing part is reported there
# and does not stop the others).
#
#   DEVICE=cuda OUT=/some/dir bash scripts/gpu_check.sh     # on the GPU machine (the default DEVICE)
#   DEVICE=cpu  OUT=/tmp/x    bash scripts/gpu_check.sh     # dry run: same steps, shrunken, on the CPU (CI)
#
# The GPU machine reaches no package registry. Bring these wheels in .whl/ (about 25 MiB in all, well under the
# 64 MiB a device run carries), downloaded here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       diffusers==0.42.1 torchao==0.18.0 importlib_metadata
# (add transformers==5.25.0 if the image's transformers cannot build the tiny Qwen-Image). The script installs
# them and the checkout (editable, no deps) when .whl/ exists. flash-attn and SageAttention >= 2 have no wheels
# on PyPI (a long nvcc build): without them their rows say "skipped" with the reason.
#
# Time budget (seconds): install 30, gpu tests 180, sdpa contract on cuda 50, probes 80, benchmark 140 = 480.
set -u -o pipefail
cd "$(dirname "$0")/.."
DEVICE="${DEVICE:-cuda}"
OUT="${OUT:?set OUT to the folder that receives gpu_check.json}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 DEVICE
if [ "$DEVICE" = "cpu" ]; then
    PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
    T_TESTS=60; T_SDPA=30; T_PROBES=60; T_BENCH=60
else
    PY="${PYTHON:-python3}"
    T_TESTS=180; T_SDPA=50; T_PROBES=80; T_BENCH=140
fi
START=$(date +%s)

# ---------------------------------------------------------------- install (GPU machine only)
if [ "$DEVICE" != "cpu" ] && [ -d .whl ]; then
    timeout 30 "$PY" -m pip install -q --no-index --no-deps .whl/*.whl > "$WORK/install.log" 2>&1
    timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . -e plugins/platforms/cuda \
        -e plugins/attention/sdpa -e plugins/attention/flash -e plugins/attention/sage -e plugins/models/qwen-image \
        -e plugins/models/shapes >> "$WORK/install.log" 2>&1
    echo "install exit $?" >> "$WORK/install.log"
fi

# ---------------------------------------------------------------- tests
GPU_TESTS=(plugins/platforms/cuda tests/optimize/test_offload.py tests/optimize/test_quantize.py
           plugins/attention/flash plugins/attention/sage)
if [ "$DEVICE" = "cpu" ]; then  # the dry run proves the selection collects (running it needs a GPU)
    MODE=(--collect-only)
else
    MODE=(-rs)
fi
timeout "$T_TESTS" "$PY" -m pytest -q "${MODE[@]}" -m gpu -p no:cacheprovider --import-mode=importlib \
    "${GPU_TESTS[@]}" > "$WORK/tests.log" 2>&1
echo "exit $?" >> "$WORK/tests.log"
timeout "$T_SDPA" "$PY" -m pytest -q "${MODE[@]}" -k cuda -p no:cacheprovider --import-mode=importlib \
    plugins/attention/sdpa > "$WORK/sdpa.log" 2>&1
echo "exit $?" >> "$WORK/sdpa.log"

# ---------------------------------------------------------------- probes and benchmark
if [ "$DEVICE" = "cpu" ]; then  # one interpreter for both: the dry run's budget is a minute on 2 cores
    timeout $((T_PROBES + T_BENCH)) "$PY" scripts/gpu_check.py all > "$WORK/probes.log" 2>&1
    echo "exit $?" >> "$WORK/probes.log"
else  # separate budgets: a slow benchmark must not eat the probes' time
    timeout "$T_PROBES" "$PY" scripts/gpu_check.py probes > "$WORK/probes.log" 2>&1
    echo "exit $?" >> "$WORK/probes.log"
    timeout "$T_BENCH" "$PY" scripts/gpu_check.py bench > "$WORK/bench.log" 2>&1
    echo "exit $?" >> "$WORK/bench.log"
fi

# ---------------------------------------------------------------- one results file
"$PY" - "$WORK" "$OUT/gpu_check.json" "$DEVICE" "$START" <<'EOF'
import json, os, sys, time
work, dest, device, start = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])

def log(name):
    path = os.path.join(work, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""

def exit_code(text):
    lines = [l for l in text.splitlines() if l.startswith("exit ")]
    return int(lines[-1].split()[1]) if lines else None

result = {"device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
          "seconds": int(time.time()) - start, "sections": {}}
for name in ("tests", "sdpa"):
    text = log(f"{name}.log")
    result["sections"][name] = {"exit": exit_code(text), "tail": text.splitlines()[-40:]}
for name in ("probes", "bench"):
    text = log(f"{name}.log")
    for line in text.splitlines():
        if line.startswith("GPUCHECK "):
            record = json.loads(line[len("GPUCHECK "):])
            result["sections"][record.pop("section")] = record
    if text and (exit_code(text) != 0 or "GPUCHECK" not in text):  # killed by its timeout, or crashed
        result["sections"][f"{name} process"] = {"exit": exit_code(text), "tail": text.splitlines()[-40:]}
if log("install.log"):
    result["sections"]["install"] = {"tail": log("install.log").splitlines()[-20:]}
with open(dest, "w") as f:
    json.dump(result, f, indent=1, default=str)
print(f"gpu_check: wrote {dest} ({result['seconds']} s)")
EOF
