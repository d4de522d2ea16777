"""Decode GEMVs on ORT CUDA: which weight layout / op gets cuBLAS closest to the copy bandwidth?

One-op graphs at the Llama-3.2-1B decode shapes (x [1, 1, K] times a constant fp16 weight):

    matmul       MatMul(x, W [K, N])                          (what the exporter writes)
    fused_t      com.microsoft.FusedMatMul(x, Wt [N, K], transB=1)
    gemm_t       Gemm(x [1, K], Wt [N, K], transB=1)

GPU time per call from torch.profiler (all kernels of the call, cuBLAS's split-K reduce included),
over 50 IOBinding runs; bandwidth = weight bytes / time.

    python benchmarks/gpu/gemv_layouts.py --out $OUT/gemv.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

SHAPES = [(2048, 3072), (2048, 2048), (2048, 8192), (2048, 16384), (8192, 2048), (2048, 128256)]
LAYOUTS = ("matmul", "fused_t", "gemm_t")


def graph(layout: str, k: int, n: int, path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((k, n)) * 0.02).astype(np.float16)
    x_shape, y_shape = ([1, k], [1, n]) if layout == "gemm_t" else ([1, 1, k], [1, 1, n])
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, x_shape)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, y_shape)
    if layout == "matmul":
        init, node = numpy_helper.from_array(w, "w"), helper.make_node("MatMul", ["x", "w"], ["y"])
    elif layout == "fused_t":
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "w")
        node = helper.make_node("FusedMatMul", ["x", "w"], ["y"], domain="com.microsoft", transB=1, alpha=1.0)
    else:
        init = numpy_helper.from_array(np.ascontiguousarray(w.T), "w")
        node = helper.make_node("Gemm", ["x", "w"], ["y"], transB=1)
    model = helper.make_model(helper.make_graph([node], "g", [x], [y], [init]),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data")


def time_graph(path: Path, x_shape: list[int], n: int) -> dict:
    import onnxruntime as ort
    import torch

    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from benchmarks.gpu.profile_decode import _kernels

    stream = torch.cuda.Stream()
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(str(path), opts, providers=[("CUDAExecutionProvider", {
        "user_compute_stream": str(stream.cuda_stream)})])
    x = torch.randn(*x_shape, dtype=torch.float16, device="cuda")
    y = torch.empty(*x_shape[:-1], n, dtype=torch.float16, device="cuda")
    b = sess.io_binding()
    b.bind_input("x", "cuda", 0, np.float16, list(x.shape), x.data_ptr())
    b.bind_output("y", "cuda", 0, np.float16, list(y.shape), y.data_ptr())
    opts_run = ort.RunOptions()
    opts_run.add_run_config_entry("disable_synchronize_execution_providers", "1")
    for _ in range(5):
        sess.run_with_iobinding(b, opts_run)
    torch.cuda.synchronize()
    reps = 50

    def run():
        with torch.cuda.stream(stream):
            for _ in range(reps):
                sess.run_with_iobinding(b, opts_run)
            stream.synchronize()

    kernels = _kernels(run)
    us = sum(v[1] for v in kernels.values()) / reps
    return {"us": round(us, 2), "kernels": {name[:90]: round(v[1] / reps, 2) for name, v in kernels.items()}}


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    if hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    sys.path.append(str(Path(__file__).resolve().parents[2]))
    from enginesmith.measure.speed import measure_copy_bandwidth

    bw = measure_copy_bandwidth()["cuda_gbs"]
    result = {"gpu": torch.cuda.get_device_name(0), "ort": ort.__version__, "copy_bandwidth_gbs": bw, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in SHAPES:
            for layout in LAYOUTS:
                path = Path(tmp) / f"{layout}_{k}_{n}.onnx"
                graph(layout, k, n, path)
                r = time_graph(path, [1, k] if layout == "gemm_t" else [1, 1, k], n)
                r.update(K=k, N=n, layout=layout, gbs=round(2 * k * n / r["us"] / 1e3, 1))
                r["pct_of_copy_bw"] = round(100 * r["gbs"] / bw, 1)
                result["rows"].append(r)
                print(f"K={k} N={n} {layout:8s} {r['us']:8.2f} us {r['gbs']:7.1f} GB/s {r['pct_of_copy_bw']:5.1f}%",
                      flush=True)
                args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
