#!/usr/bin/env bash
# One install for GPU users, checked on the GPU machine from a built wheel (issue 23).
#
# Run from the repository root on the device machine, after staging onnxruntime-gpu, cmake and ninja
# (their wheels install into /tmp/site, which env.sh puts on PYTHONPATH):
#
#   python3 ../shared/device/stage.py ort-gpu
#   python3 ../shared/device/stage.py wheels cmake ninja
#   (the printed calls; the last one:) bash .device/assemble.sh && source /tmp/stage/env.sh && \
#       bash benchmarks/gpu/wheel_check.sh
#
# It builds a wheel of this checkout, installs it into /tmp/site without dependencies (torch,
# transformers, onnx are the machine's own), and then, with nothing compiled by hand and an empty
# cache, runs: doctor, plugins build (compiles the CUDA libraries from the wheel's sources), plugins
# build again (a cache hit), build --for-cuda --custom-ops on, run and bench on CUDA. Everything goes to
# $OUT/wheel_check.log; the exit status is the number of failed steps.
set -uo pipefail

OUT="${OUT:-/tmp/wheel_check_out}"
mkdir -p "$OUT"
LOG="$OUT/wheel_check.log"
REPO="$(pwd)"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export ENGINESMITH_CACHE=/tmp/es-wheel-cache   # empty: the libraries must compile on first use
export HF_HUB_OFFLINE=1
MODEL="${MODEL:-random:llama-3.2-1b}"   # a Llama-3.2-1B-shaped random model (MODEL=tiny:llama for a quick try)
unset ENGINESMITH_PLUGINS_BUILD ENGINESMITH_ORT_OPS_LIB ENGINESMITH_KERNELS_LIB
rm -rf "$ENGINESMITH_CACHE" /tmp/wheel /tmp/e
failed=0

step() {  # step NAME CMD...: run, time and log one step; count a failure and go on
    local name="$1"; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return 0
}

{
    echo "=== machine"
    nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
    python3 --version
    python3 -c "import torch, onnxruntime as o; print('torch', torch.__version__, 'cuda', torch.version.cuda); print('onnxruntime', o.__version__, o.__file__, o.get_available_providers())"
    command -v cmake ninja nvcc

    step wheel python3 -m pip wheel -q --no-deps --no-build-isolation "$REPO" -w /tmp/wheel
    WHEEL=$(ls /tmp/wheel/enginesmith-*.whl)
    step wheel-sources python3 - "$WHEEL" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
src = sorted(n for n in names if n.startswith("enginesmith/plugins/") and not n.endswith(".py"))
print(f"{len(src)} plugin files in the wheel, e.g.:", *src[:4], sep="\n  ")
assert "enginesmith/plugins/CMakeLists.txt" in names and "enginesmith/plugins/ort_ops/ort_ops.cpp" in names
EOF
    step install python3 -m pip install -q --no-deps --upgrade --target /tmp/site "$WHEEL"
    cd /tmp  # away from the checkout: the installed copy is the one imported
    ES=(python3 -m enginesmith.cli)
    [ -x /tmp/site/bin/enginesmith ] && ES=(/tmp/site/bin/enginesmith)
    step installed-copy python3 -c "import enginesmith.plugins.compile as c; print(c.PLUGINS_DIR); assert c.PLUGINS_DIR.is_relative_to('/tmp/site'), 'not the wheel'; assert (c.PLUGINS_DIR / 'CMakeLists.txt').is_file()"

    step doctor "${ES[@]}" doctor
    step plugins-build "${ES[@]}" plugins build
    step plugins-build-again "${ES[@]}" plugins build        # a cache hit: no "compiling" line
    step doctor-after "${ES[@]}" doctor --json
    step build "${ES[@]}" build --model "$MODEL" --dtype fp16 --for-cuda --custom-ops on --out /tmp/e
    python3 -c "import json; m = json.load(open('/tmp/e/build.json')); print('passes:', m['passes'][-4:])"
    step run "${ES[@]}" run --engine /tmp/e --device cuda --raw hello --max-tokens 16
    step bench "${ES[@]}" bench --engine /tmp/e --device cuda
    ls -la "$ENGINESMITH_CACHE/kernels" "$ENGINESMITH_CACHE"/kernels/*/
    echo "=== failed steps: $failed"
} 2>&1 | tee "$LOG"

exit "$(grep -o 'failed steps: [0-9]*' "$LOG" | tail -1 | grep -o '[0-9]*$')"
