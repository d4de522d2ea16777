#!/usr/bin/env bash
# One device call of gpu_serving.sh whose outputs come back as one archive ($OUT/results.tgz): the device
# tool returns at most 8 files a call. PHASES as in gpu_serving.sh.
set -u
OUT_FINAL="$OUT"
export OUT=/tmp/serving_out_$$
mkdir -p "$OUT"
timeout "${LIMIT_S:-560}" bash benchmarks/serving/gpu_serving.sh > /dev/null 2>&1  # leave time to pack
tar czf "$OUT_FINAL/results.tgz" -C "$OUT" .
grep -E "^=== |rc=|tok/s|passed|failed|Error|error" "$OUT/serving.log" | tail -80
