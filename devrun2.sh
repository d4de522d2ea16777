#!/bin/bash
R=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
( cmake -S plugins -B /tmp/pb -DCMAKE_CUDA_ARCHITECTURES=90 -DENGINESMITH_BUILD_TRT_PLUGINS=OFF >/dev/null && cmake --build /tmp/pb -j 16 --target enginesmith_kernels ) 2>&1 | tail -1
export ENGINESMITH_PLUGINS_BUILD=/tmp/pb
python3 benchmarks/plugins/bench_plugins.py --out $OUT/paged_prefetch.json --decode-only --skip-sparse --contexts 1024,8192,16384,32768 --batches 1,4 --reduce two,two-prefetch,wkv-two,wkv-prefetch 2>&1 | grep -v '^{' | tail -10
python3 benchmarks/plugins/bench_plugins.py --out $OUT/sparse_rowT.json --skip-attention 2>&1 | grep -v '^{' | grep -v Warn | tail -2
ES_SPARSE_LAYOUT=sparse_b python3 benchmarks/plugins/bench_plugins.py --out $OUT/sparse_b.json --skip-attention 2>&1 | grep -v '^{' | grep -v Warn| tail -2
python3 - <<'PY'
import json, os
a = json.load(open(os.environ["OUT"] + "/sparse_rowT.json"))["sparse_gemm"]
b = json.load(open(os.environ["OUT"] + "/sparse_b.json"))["sparse_gemm"]
for r, s in zip(a, b):
    print(r["K"], r["N"], r["M"], "dense", r["dense_ms"], s["dense_ms"], "rowT", r["ours_ms"], "sparseB", s["ours_ms"], "torch", r["torch_semi_structured_ms"],
          "x_dense rowT", r["speedup_vs_dense"], "sparseB", s["speedup_vs_dense"], "err", r["max_rel_err"], s["max_rel_err"])
PY
cd /tmp && ES_SPARSE_LAYOUT=sparse_b timeout 200 python3 -m pytest -q -m gpu $R/tests/plugins/test_sparse_gemm.py -p no:cacheprovider -rfE 2>&1 | tail -4
timeout 200 python3 -m pytest -q -m gpu $R/tests/plugins/test_paged_attention.py $R/tests/plugins/test_sparse_gemm.py -p no:cacheprovider -rfE 2>&1 | tail -3
