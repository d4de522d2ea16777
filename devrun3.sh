#!/bin/bash
R=$PWD
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
( cmake -S plugins -B /tmp/pb -DCMAKE_CUDA_ARCHITECTURES=90 -DENGINESMITH_BUILD_TRT_PLUGINS=OFF >/dev/null && cmake --build /tmp/pb -j 16 ) 2>&1 | tail -1
export ENGINESMITH_PLUGINS_BUILD=/tmp/pb ENGINESMITH_ORT_OPS_LIB=/tmp/pb/libenginesmith_ort_ops.so
timeout 300 python3 benchmarks/plugins/bench_plugins.py --out $OUT/full.json --reduce two,two-prefetch 2>&1 | grep -v '^{' | grep -v Warn | grep -v "return cls" | tail -40
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/full.json"))
print(d["device"], "copy", d["copy_bandwidth_GBps"], "read", d["read_bandwidth_GBps"], "s", d["seconds"])
print("max err vs sdpa", max(r["max_err_vs_sdpa"] for r in d["paged_attention"]))
for r in d["sparse_gemm"]:
    if r["M"] >= 256:
        print(r["K"], r["N"], r["M"], "x_dense", r["speedup_vs_dense"], "x_torch", r["speedup_vs_torch_sparse"])
PY
cd /tmp && timeout 240 python3 -m pytest -q -m gpu $R/tests/plugins $R/tests/test_ort_cuda.py $R/tests/test_kv_paged.py -p no:cacheprovider -rfE 2>&1 | tail -6
