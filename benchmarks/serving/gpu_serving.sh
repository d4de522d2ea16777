#!/usr/bin/env bash
# Issue 18's figures and GPU tests, in one session on one card (run from the repository root on the
# device machine, after staging onnxruntime-gpu, cmake, ninja, rdata+xarray (the Austen corpus reader)
# and onnxruntime-genai-cuda; see benchmarks/serving/README.md). Carry .device/janeaustenr (the corpus
# data) and .device/peers/ortgenai_bench.py (from ../shared/peers).
#
#   PHASES="profile tests fp16 hf genai w4a16 http" bash benchmarks/serving/gpu_serving.sh
#
# profile where a decode step spends its time (benchmarks/serving/profile_step.py)
# tests  the GPU tests of the paged op and the paged engine (identity of 32 mixed requests, 2,000
#        random requests without a leaked page)
# fp16   1B Llama shape (random weights) fp16 paged engine: offline throughput at concurrency 1 / 16 / 64
#        (prompt 512, output 256), decode-step bandwidth fraction; 256 Austen-drawn requests at 64
# hf     HF generate at batch 64 (static cache)
# genai  ONNX Runtime GenAI at batch 32 and 64 (GENAI="32:off 64:off", batch:cuda-graph)
# w4a16  the same engine with --quant w4a16-rtn, concurrency 1 / 16 / 64
# http   issue 19: bench serve at 1 / 16 / 64 against enginesmith serve and a real tritonserver
#        (benchmarks/serving/gpu_http.py; stage starlette, uvicorn, nvidia-pytriton and a numpy<2 file)
# Everything goes to $OUT (serving.log and JSON files).
set -uo pipefail
OUT="${OUT:-/tmp/serving_out}"
mkdir -p "$OUT"
LOG="$OUT/serving.log"
REPO="$(pwd)"
PHASES="${PHASES:-profile tests fp16 hf genai w4a16 http}"
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export ENGINESMITH_CACHE=/tmp/esc HF_HUB_OFFLINE=1
export ENGINESMITH_JANEAUSTENR="$REPO/.device/janeaustenr"
MODEL="${MODEL:-random:llama-3.2-1b}"
failed=0
step() {
    local name="$1"; shift
    echo "=== $name: $*" >&2
    local t0=$SECONDS
    "$@"
    local rc=$?
    echo "=== $name: rc=$rc, $((SECONDS - t0)) s" >&2
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    return 0
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -m pip install -q --no-deps --no-build-isolation --upgrade --target /tmp/site . 2>&1 | tail -2
    cd /tmp  # away from the checkout, whose enginesmith/ would shadow the installed package
    ES=(python3 -m enginesmith.cli)
    LIBS=$("${ES[@]}" plugins build --arch 90 2>&1 | tail -3)
    echo "$LIBS"
    DIR=$(dirname "$(echo "$LIBS" | grep ort_ops | head -1)")
    export ENGINESMITH_PLUGINS_BUILD="$DIR" ENGINESMITH_ORT_OPS_LIB="$DIR/libenginesmith_ort_ops.so" \
           ENGINESMITH_KERNELS_LIB="$DIR/libenginesmith_kernels.so"
    if [[ " $PHASES " == *" profile "* ]]; then
        [ -d /tmp/e/fp16 ] || step build-fp16 "${ES[@]}" build --model "$MODEL" --dtype fp16 --for-cuda --kv paged \
            --page-size 16 --max-batch 64 --capacity 2048 --out /tmp/e/fp16
        step profile python3 "$REPO/benchmarks/serving/profile_step.py" --engine /tmp/e/fp16 --batch 1,16,64 \
            --json-out "$OUT/profile_step.json"
        ES_BATCH_INVARIANT=1 step profile-invariant python3 "$REPO/benchmarks/serving/profile_step.py" \
            --engine /tmp/e/fp16 --batch 1,16,64 --timed-only --json-out "$OUT/profile_step_invariant.json"
    fi
    if [[ " $PHASES " == *" tests "* ]]; then
        cd "$REPO/tests"
        step gpu-tests python3 -m pytest -q -m gpu ${GPU_TESTS:-plugins/test_ort_paged_attention.py plugins/test_ort_paged_attention_options.py plugins/test_ort_attention.py plugins/test_ort_attention_kv_quant.py passes/test_paged_gqa.py runtime/test_paged_cuda.py models/test_paged_families.py runtime/test_dense_kv_quant.py models/test_families.py measure/test_throughput_bench.py} -p no:cacheprovider
        cd /tmp
    fi
    B=(--dtype fp16 --for-cuda --kv paged --page-size 16 --max-batch 64 --capacity 2048)
    R=(--prompt-tokens 512 --new-tokens 256 --json)
    if [[ " $PHASES " == *" fp16 "* ]]; then
        [ -d /tmp/e/fp16 ] || step build-fp16 "${ES[@]}" build --model "$MODEL" "${B[@]}" --out /tmp/e/fp16
        step single-fp16 "${ES[@]}" bench --engine /tmp/e/fp16 --device cuda --requests 4 --concurrency 1 "${R[@]}" \
            > "$OUT/single_fp16.json"
        step offline-fp16 "${ES[@]}" bench --engine /tmp/e/fp16 --device cuda --requests 64 --concurrency 16,64 \
            "${R[@]}" --png "$OUT/throughput_fp16.png" > "$OUT/offline_fp16.json"
        step drawn "${ES[@]}" bench --engine /tmp/e/fp16 --device cuda --requests 256 --concurrency 64 --json \
            > "$OUT/drawn_fp16.json"
    fi
    if [[ " $PHASES " == *" hf "* ]]; then
        step hf-generate python3 "$REPO/benchmarks/serving/hf_generate_batch.py" --model "$MODEL" --batch 64 \
            --prompt-tokens 512 --new-tokens 256 --repeats 1 --json-out "$OUT/hf_generate.json"
    fi
    if [[ " $PHASES " == *" genai "* ]]; then
        for g in ${GENAI:-"32:off 64:off"}; do set -- ${g/:/ }
            step "ortgenai-b$1-graph-$2" python3 "$REPO/.device/peers/ortgenai_bench.py" --size 1b --ep cuda --batch "$1" \
                --prompt-len 512 --new-tokens 256 --cuda-graph "$2" --precisions fp16 --work /tmp/gw \
                --json-out "$OUT/ortgenai.jsonl"
        done
    fi
    if [[ " $PHASES " == *" w4a16 "* ]]; then
        [ -d /tmp/e/w4a16 ] || step build-w4a16 "${ES[@]}" build --model "$MODEL" "${B[@]}" --quant w4a16-rtn --out /tmp/e/w4a16
        step single-w4a16 "${ES[@]}" bench --engine /tmp/e/w4a16 --device cuda --requests 4 --concurrency 1 "${R[@]}" \
            > "$OUT/single_w4a16.json"
        step offline-w4a16 "${ES[@]}" bench --engine /tmp/e/w4a16 --device cuda --requests 64 --concurrency 16,64 \
            "${R[@]}" --png "$OUT/throughput_w4a16.png" > "$OUT/offline_w4a16.json"
    fi
    if [[ " $PHASES " == *" http "* ]]; then
        [ -d /tmp/e/fp16 ] || step build-fp16 "${ES[@]}" build --model "$MODEL" "${B[@]}" --out /tmp/e/fp16
        ENGINESMITH_TRITON_WHEELS="${TRITON_WHEELS:-/tmp/npw}" step http python3 "$REPO/benchmarks/serving/gpu_http.py" \
            --engine /tmp/e/fp16 --requests "${HTTP_REQUESTS:-128}" --out-dir "$OUT" --servers "${SERVERS:-ours,triton}" \
            --concurrency "${HTTP_CONCURRENCY:-1,16,64}"
    fi
    echo "=== failed steps: $failed"
} 2>&1 | tee "$LOG"
