#!/usr/bin/env bash
# `enginesmith serve` with the engine core in a thread vs in its own process (--engine-core), one run:
# the tiny paged CPU engine (tiny:llama, random weights; built once and cached by serve --model), `enginesmith bench serve` at 16 and 64 streams.
# Each server is started on 127.0.0.1, measured, then stopped by its PID (the core exits with it).
#
# With FRONT_ENDS="1 2" the process core also runs with `serve --front-ends 2` (several front ends, one core).
#
#     bash benchmarks/serving/engine_core_cpu.sh [REQUESTS] [NEW_TOKENS]     # defaults 128, 32
#     FRONT_ENDS="1 2" CORES=process bash benchmarks/serving/engine_core_cpu.sh
set -euo pipefail
REQUESTS=${1:-128}
NEW=${2:-32}
cd "${TMPDIR:-/tmp}"  # not the checkout: its enginesmith/ folder would shadow the installed package
for core in ${CORES:-thread process}; do for fe in ${FRONT_ENDS:-1}; do
  [ "$core" = thread ] && [ "$fe" != 1 ] && continue  # --front-ends N > 1 needs the core in a process
  out=$(mktemp) err=$(mktemp)
  python -m enginesmith.cli serve --model tiny:llama --port 0 --threads 1 --max-batch 64 --engine-core "$core" \
    --front-ends "$fe" >"$out" 2>"$err" &
  pid=$!
  for _ in $(seq 600); do grep -q "enginesmith serve: http" "$out" && break; sleep 0.1; done
  url=$(grep -o 'http://127.0.0.1:[0-9]*' "$out")
  echo "== --engine-core $core --front-ends $fe ($url)"
  python -m enginesmith.cli bench serve --url "$url" --concurrency 16,64 --requests "$REQUESTS" \
    --prompt-tokens 32 --new-tokens "$NEW" --ignore-eos --tokenizer tiny:llama || true
  kill -TERM "$pid"; wait "$pid" || true
  rm -f "$out" "$err"
done; done
