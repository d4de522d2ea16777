"""Where a GEMM-path call of the ORT custom ops (5 rows or more) spends its GPU time: one op per
session (int4 SwiGLU, an int4 lm_head slice set, fp16 SwiGLU) at M = 16 and 128, torch.profiler over
ORT runs. GPU machine only; the ops library from $ENGINESMITH_ORT_OPS_LIB or the plugins build dir.

    python3 benchmarks/gpu/int4_gemm_path.py
"""
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "plugins"))
import onnxruntime as ort
from onnx import helper, numpy_helper, TensorProto as T
import test_ort_ops as t
from torch.profiler import profile, ProfilerActivity
ort.preload_dlls()
from enginesmith.plugins import ort_ops  # noqa: E402

lib = str(ort_ops.require())
rng = np.random.default_rng(0)
for (n, k, op) in ((8192, 2048, "SwiGluGemvQ4"), (32768, 2048, "GemvQ4"), (8192, 2048, "SwiGluGemv")):
    bs = 128
    w, q, s, _ = t._weights(rng, n, k, bs)
    wu, qu, su, _ = t._weights(rng, n, k, bs)
    ins = {"SwiGluGemvQ4": ["x", "b", "s", "bu", "su"], "GemvQ4": ["x", "b", "s"], "SwiGluGemv": ["x", "w", "wu"]}[op]
    attrs = dict(K=k, N=n, block_size=bs) if op.endswith("Q4") else {}
    inits = {"w": w, "wu": wu, "b": t._pack(q, bs), "s": s.reshape(-1), "bu": t._pack(qu, bs), "su": su.reshape(-1)}
    node = helper.make_node(op, ins, ["y"], domain="com.enginesmith", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", T.FLOAT16, [None, k])],
                          [helper.make_tensor_value_info("y", T.FLOAT16, None)],
                          [numpy_helper.from_array(a, nm) for nm, a in inits.items() if nm in ins])
    m = helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1)])
    opts = ort.SessionOptions(); opts.register_custom_ops_library(lib); opts.log_severity_level = 3
    sess = ort.InferenceSession(m.SerializeToString(), opts, providers=["CUDAExecutionProvider"])
    for M in (16, 128):
        x = torch.randn(M, k, dtype=torch.float16, device="cuda")
        y = torch.empty(M, n, dtype=torch.float16, device="cuda")
        io = sess.io_binding()
        io.bind_input("x", "cuda", 0, np.float16, [M, k], x.data_ptr())
        io.bind_output("y", "cuda", 0, np.float16, [M, n], y.data_ptr())
        for _ in range(3): sess.run_with_iobinding(io)
        torch.cuda.synchronize()
        import time; t0 = time.perf_counter()
        for _ in range(10): sess.run_with_iobinding(io)
        torch.cuda.synchronize(); wall = (time.perf_counter() - t0) / 10 * 1e3
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            for _ in range(5): sess.run_with_iobinding(io)
            torch.cuda.synchronize()
        ev = [(e.key, e.device_time_total / 5, e.count / 5) for e in p.key_averages() if e.device_time_total > 0]
        ev.sort(key=lambda r: -r[1])
        print(f"{op} N={n} K={k} M={M}: wall {wall:.3f} ms/run; weight MB {n*k/2/1e6 if op.endswith('Q4') else n*k*2/1e6:.1f}")
        for key, us, c in ev[:6]:
            print(f"    {us:9.1f} us  x{c:.0f}  {key[:110]}")
