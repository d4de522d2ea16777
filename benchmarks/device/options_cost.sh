#!/usr/bin/env bash
# What reading soft-capping and windows at run time costs the attention kernels (plugins/common/
# plain_variants.h): builds the ops and kernels libraries with ENGINESMITH_PLAIN_VARIANTS=all (each
# kernel's plain variant beside the options one), then times the same calls twice in separate
# processes, ES_OPTIONS_KERNEL=0 (plain variants) and =1 (options variants), twice each, alternating:
#   the dense attention op (benchmarks/gpu/attention_op.py: decode and prompt points, GPU time per call)
#   the paged kernel (benchmarks/plugins/bench_plugins.py --quick: decode, batch 1 and 16, 1k and 8k).
# GPU machine only. Usage: bash benchmarks/device/options_cost.sh [OUT_DIR]   (default $OUT or /tmp)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-/tmp}}"
ARCH="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)"
BUILD=/tmp/plain-variants-build
LOG="$OUT_DIR/options_cost.log"
{
  echo "card: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), sm_$ARCH"
  start=$(date +%s)
  cmake -S plugins -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$ARCH" \
    -DENGINESMITH_BUILD_TRT_PLUGINS=OFF -DENGINESMITH_PLAIN_VARIANTS=all >/dev/null &&
    ninja -C "$BUILD" enginesmith_ort_ops enginesmith_kernels >/dev/null || { echo "build failed"; exit 1; }
  echo "plain-variants build: $(( $(date +%s) - start )) s"
  export ENGINESMITH_ORT_OPS_LIB="$BUILD/libenginesmith_ort_ops.so" ENGINESMITH_KERNELS_LIB="$BUILD/libenginesmith_kernels.so"
  for round in 1 2; do
    for forced in 0 1; do
      echo "=== round $round, ES_OPTIONS_KERNEL=$forced (0: plain variants, 1: options variants)"
      ES_OPTIONS_KERNEL=$forced timeout 120 python3 benchmarks/gpu/attention_op.py \
        --points 300:512,3000:4096,7000:8192,0:4096:128 2>&1 | grep enginesmith
      ES_OPTIONS_KERNEL=$forced timeout 180 python3 benchmarks/plugins/bench_plugins.py --quick --skip-sparse \
        --no-host-loop --out "$OUT_DIR/options_cost_paged_${round}_${forced}.json" 2>&1 | python3 -c '
import json, sys
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        continue
    if isinstance(r, dict) and "query_len" in r and "ms" in r:
        print("paged B=%(batch)s ctx=%(context)s Sq=%(query_len)s D=%(D)s: %(ms).5f ms %(pct_of_copy_bw)s %%" % r)'
    done
  done
} 2>&1 | tee "$LOG"
