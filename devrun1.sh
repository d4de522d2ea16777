#!/bin/bash
R=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
( cmake -S plugins -B /tmp/pb -DCMAKE_CUDA_ARCHITECTURES=90 -DENGINESMITH_BUILD_TRT_PLUGINS=OFF >/dev/null && cmake --build /tmp/pb -j 16 ) 2>&1 | tail -2
export ENGINESMITH_PLUGINS_BUILD=/tmp/pb ENGINESMITH_ORT_OPS_LIB=/tmp/pb/libenginesmith_ort_ops.so
python3 benchmarks/plugins/bench_plugins.py --out $OUT/paged_prefetch.json --decode-only --skip-sparse --contexts 1024,8192,16384,32768 --batches 1,4 --reduce two,two-prefetch,wkv-two,wkv-prefetch 2>&1 | grep -v '^{' | tail -12
python3 benchmarks/plugins/bench_plugins.py --out $OUT/sparse.json --skip-attention 2>&1 | grep -v '^{' | tail -4
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/sparse.json"))
for r in d["sparse_gemm"]:
    if r["M"] >= 256:
        print(r["K"], r["N"], r["M"], "dense", r["dense_ms"], "ours", r["ours_ms"], "torch", r["torch_semi_structured_ms"],
              "x_dense", r["speedup_vs_dense"], "x_torch", r["speedup_vs_torch_sparse"])
PY
cd /tmp && timeout 330 python3 -m pytest -q -m gpu $R/tests/plugins/test_paged_attention.py $R/tests/plugins/test_sparse_gemm.py $R/tests/test_kv_paged.py -p no:cacheprovider -rfE 2>&1 | tail -25
