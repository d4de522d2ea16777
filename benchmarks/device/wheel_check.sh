#!/usr/bin/env bash
# The binary wheel on the GPU machine (issue 27, goal 2): built from libraries already compiled,
# installed into a fresh venv with no nvcc on PATH, then doctor, an engine with our ops, and bench.
#
#   bash benchmarks/device/wheel_check.sh [LIBS]          (repository root; verify.sh's phase "wheel" runs it)
#
# LIBS: the compiled libraries (default $ENGINESMITH_PLUGINS_BUILD): a CMake build folder, a cache entry
# (meta.json), or verify.sh's carried libraries (verify_libs.json). Needs staging as for verify.sh
# (onnxruntime-gpu in /tmp/site on PYTHONPATH, or STAGED_SITE=DIR; torch there or in the system's
# site-packages). MODEL: the engine's
# model (default random:llama-3.2-1b; MODEL=tiny:llama for a quick try). Writes $OUT/wheel_check.log,
# doctor.json, bench.json; the exit status is the number of failed steps.
set -uo pipefail
REPO="$(pwd)"
OUT="${OUT:-/tmp/wheel_check_out}"
W=/tmp/wheel_check
LIBS="${1:-${ENGINESMITH_PLUGINS_BUILD:-}}"
MODEL="${MODEL:-random:llama-3.2-1b}"
rm -rf "$W" && mkdir -p "$W/pythonpath" "$OUT"
exec > >(tee "$OUT/wheel_check.log") 2>&1
failed=0
step() {  # step [-o FILE] NAME CMD...: run and time one step (stdout to FILE); a failure is counted, the script goes on
    local o=/dev/stdout; [ "$1" = -o ] && { o="$2"; shift 2; }
    local name="$1" t0=$SECONDS; shift
    echo "=== $name: $*"
    "$@" > "$o"; local rc=$?
    echo "=== $name: rc=$rc, $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return "$rc"
}
if [ ! -f "$LIBS/libenginesmith_ort_ops.so" ] || [ ! -f "$LIBS/libenginesmith_kernels.so" ]; then
    echo "wheel_check: no compiled libraries in '${LIBS}' (pass a folder, or set ENGINESMITH_PLUGINS_BUILD)"; exit 2
fi
FROM="$LIBS"
if [ ! -f "$LIBS/CMakeCache.txt" ] && [ ! -f "$LIBS/meta.json" ]; then  # carried: make the meta.json the hook checks
    FROM="$W/from" && mkdir -p "$FROM" && cp "$LIBS"/libenginesmith_{ort_ops,kernels}.so "$FROM/"
    python3 -c "import json, sys; m = json.load(open(sys.argv[1])); json.dump({'archs': [m['arch']],
        'sources_sha256': m['sources_sha256'], 'libraries': m['libraries']}, open(sys.argv[2], 'w'))" \
        "$LIBS/verify_libs.json" "$FROM/meta.json" || exit 2
fi
ARCHS=$(python3 -P -c "import json, re, sys, pathlib; f = pathlib.Path(sys.argv[1])
c = f / 'CMakeCache.txt'
print(re.search(r'^CMAKE_CUDA_ARCHITECTURES:\w+=(.*)$', c.read_text(), re.M).group(1) if c.is_file()
      else ';'.join(json.load(open(f / 'meta.json'))['archs']))" "$FROM")
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
echo "libraries from $LIBS, archs $ARCHS"

cd "$W"  # away from the checkout: its enginesmith/ must not be imported
mkdir -p "$W/src" && tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude='./.device*' --exclude=./build \
    -cf - . | tar -C "$W/src" -xf -   # a copy: pip builds in the tree it is given
step wheel env -u TENSORRT_ROOT ENGINESMITH_KERNEL_ARCHS="$ARCHS" ENGINESMITH_PREBUILT_FROM="$FROM" \
    python3 -m pip wheel -q --no-deps --no-build-isolation "$W/src" -w "$W/dist" || exit 1
WHEEL=$(ls "$W"/dist/enginesmith-*.whl)
python3 -m zipfile -l "$WHEEL" | grep prebuilt/
# a fresh venv (without pip: ensurepip may be absent), the wheel installed into it by the outer pip
step venv python3 -m venv --without-pip --system-site-packages "$W/venv" || exit 1
VENV_SITE=$("$W/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
step install python3 -m pip install -q --no-deps --target "$VENV_SITE" "$WHEEL" || exit 1
# --system-site-packages reaches the base interpreter's packages only; where python3 is itself a venv (the
# device's torch venv) its packages (torch, transformers, tqdm ...) come in through a .pth file.
python3 -c "import site; print('\n'.join(site.getsitepackages()))" > "$VENV_SITE/outer-site-packages.pth"
# The staged packages (onnxruntime-gpu ...) without the enginesmith that verify.sh installed there; PATH
# without nvcc (and without /tmp/site/bin's cmake and ninja); an empty cache, which must stay empty.
SITE="${STAGED_SITE:-/tmp/site}"
for p in "$SITE"/*; do case "$(basename "$p")" in enginesmith*|__editable__*|bin) ;; *) ln -s "$p" "$W/pythonpath/" ;; esac; done
NOCUDA=$(echo "$PATH" | tr ':' '\n' | while read -r d; do [ -x "$d/nvcc" ] || [ "$d" = "$SITE/bin" ] || echo "$d"; done | paste -sd:)
export PATH="$W/venv/bin:$NOCUDA" PYTHONPATH="$W/pythonpath" ENGINESMITH_CACHE="$W/cache"
enginesmith() { "$W/venv/bin/python" -P -m enginesmith.cli "$@"; }
unset CUDACXX ENGINESMITH_PLUGINS_BUILD ENGINESMITH_ORT_OPS_LIB ENGINESMITH_KERNELS_LIB
echo "nvcc on PATH: $(command -v nvcc || echo none)"
step doctor enginesmith doctor
enginesmith doctor --json > "$OUT/doctor.json"
step origin python3 -c "import json, sys; c = {k['name']: k for k in json.load(open(sys.argv[1]))['checks']}
o = {n: c[n]['details'].get('origin') for n in ('ops library', 'kernels library')}; print(o)
assert set(o.values()) == {'wheel'}, 'not the wheel libraries'" "$OUT/doctor.json"
step build enginesmith build --model "$MODEL" --dtype fp16 --for-cuda --custom-ops on --custom-attention \
    --capacity 1024 --out "$W/e"
step -o "$OUT/bench.json" bench enginesmith bench --engine "$W/e" --device cuda --prompt-tokens 128 \
    --new-tokens 128 --repeats 3 --json && cat "$OUT/bench.json"
step nothing-compiled bash -c "! ls '$W/cache/kernels' 2>/dev/null | grep -q ."
echo "=== failed steps: $failed"
exit "$failed"
