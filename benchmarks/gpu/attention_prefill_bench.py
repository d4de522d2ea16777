"""The attention op's prompt path (issue 20): enginesmith's GroupQueryAttention alone against ORT CUDA's
com.microsoft.GroupQueryAttention (flash attention for prompts), one call, Llama-3.2-1B's heads (32 query,
8 KV, head size 64), batch 1, past and present bound to one device buffer (as the engines bind them).

Points (past:capacity:new tokens): a 4096-token prompt (time to first token of one layer's attention;
the goal: ours <= 1.1x ORT's), a prompt chunk after a past, and a decode step at 8k context (capacity
bound as total_sequence_length, as the engines' CUDA graphs bind it). Each op runs in its own session;
ours twice: the tensor-core prompt path ($ES_GQA_PREFILL=1, read per call), and today's kernel.
Per variant: GPU time per call (torch.profiler: the sum of the call's kernels, and the top kernels) and
wall time per run_with_iobinding (median, host overhead included). GPU machine only; the ops library
from $ENGINESMITH_ORT_OPS_LIB (or the plugins build dir). JSON to --out (and stdout).

    python3 benchmarks/gpu/attention_prefill_bench.py [--points 0:4160:4096,4000:8192:192,8000:8192:1] \\
        [--heads 32:8:64] [--out $OUT/attention_prefill.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_POINTS = "0:4160:4096,4000:8192:192,8000:8192:1"


def _bound(sess, feeds, new: int, h: int, d: int):
    """IOBinding of `feeds` on the device; present K/V bound to the past's buffers. Returns (io, keep)."""
    import torch

    dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items() if k != "total_sequence_length"}
    out = torch.empty(1, new, h * d, dtype=torch.float16, device="cuda")
    io = sess.io_binding()
    for k, t in dev.items():
        io.bind_input(k, "cuda", 0, np.float16 if t.dtype == torch.float16 else np.int32, list(t.shape), t.data_ptr())
    io.bind_cpu_input("total_sequence_length", feeds["total_sequence_length"])
    io.bind_output("out", "cuda", 0, np.float16, [1, new, h * d], out.data_ptr())
    for name, src in (("present_key", "past_key"), ("present_value", "past_value")):
        io.bind_output(name, "cuda", 0, np.float16, list(dev[src].shape), dev[src].data_ptr())
    return io, (dev, out)


def _time(sess, io, runs: int) -> dict:
    """GPU time per call (profiled kernels) and wall time per run (median)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        sess.run_with_iobinding(io)
    torch.cuda.synchronize()
    walls = []
    for _ in range(runs):
        t = time.perf_counter()
        sess.run_with_iobinding(io)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            sess.run_with_iobinding(io)
        torch.cuda.synchronize()
    kernels = sorted(((e.key, e.device_time_total / runs) for e in prof.key_averages() if e.device_time_total > 0),
                     key=lambda r: -r[1])
    return {"gpu_us": round(sum(us for _, us in kernels), 2), "wall_ms": round(statistics.median(walls), 4),
            "kernels": [{"name": k[:120], "us": round(us, 2)} for k, us in kernels[:5]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=DEFAULT_POINTS, help="comma list of past:capacity:new tokens")
    ap.add_argument("--heads", default="32:8:64", help="query heads:KV heads:head size")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--out", help="JSON file to write")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    import torch

    sys.path.insert(0, str(ROOT / "tests" / "plugins"))
    from test_ort_attention import _feeds, _model

    from enginesmith.plugins import ort_ops

    ort.preload_dlls()
    lib = str(ort_ops.require())
    h, hkv, d = (int(v) for v in args.heads.split(":"))
    result = {"device": torch.cuda.get_device_name(0), "onnxruntime": ort.__version__, "heads": [h, hkv, d],
              "batch": 1, "runs": args.runs, "points": []}
    for point in args.points.split(","):
        past, cap, new = (int(v) for v in point.split(":"))
        feeds = _feeds(np.random.default_rng(0), 1, new, h, hkv, d, cap, [past])
        if new == 1:
            feeds["total_sequence_length"] = np.array(cap, np.int32)
        row = {"past": past, "capacity": cap, "new": new}
        for name, ours, env in (("enginesmith", True, "1"), ("enginesmith_today", True, "0"),
                                ("ort_gqa", False, None)):
            if env == "0" and new == 1:
                continue  # decode: one path
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.register_custom_ops_library(lib)
            sess = ort.InferenceSession(_model(ours, h, hkv, d, 1.0 / np.sqrt(d)).SerializeToString(), opts,
                                        providers=["CUDAExecutionProvider"])
            io, _keep = _bound(sess, feeds, new, h, d)
            os.environ.pop("ES_GQA_PREFILL", None)
            if env is not None:
                os.environ["ES_GQA_PREFILL"] = env
            row[name] = _time(sess, io, args.runs)
            os.environ.pop("ES_GQA_PREFILL", None)
            print(f"past={past:5d} capacity={cap:5d} new={new:5d} {name:18s} {row[name]['gpu_us']:10.2f} us GPU "
                  f"{row[name]['wall_ms']:8.3f} ms wall  {row[name]['kernels'][0]['name'][:60]}", flush=True)
        row["ours_over_ort_gpu"] = round(row["enginesmith"]["gpu_us"] / row["ort_gqa"]["gpu_us"], 3)
        if new > 1:
            flops = 4 * h * d * sum(past + s + 1 for s in range(new))  # causal q·k and p·v
            row["tflops"] = {k: round(flops / (row[k]["gpu_us"] * 1e6), 1)
                             for k in ("enginesmith", "enginesmith_today", "ort_gqa")}
        result["points"].append(row)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
