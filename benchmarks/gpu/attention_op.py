"""enginesmith's GroupQueryAttention op against ORT CUDA's com.microsoft.GroupQueryAttention, one
call in isolation: per-kernel GPU time (torch.profiler over 20 IOBinding runs) at a few
(past tokens, capacity[, new tokens: 1 = a decode step, more = a prompt]) points, Llama-3.2-1B's
heads (32 query, 8 KV, head size 64), batch 1. total_sequence_length is bound as the engines bind it:
the capacity for decode steps (CUDA graphs), past + new for prompts. GPU machine
only; the ops library from $ENGINESMITH_ORT_OPS_LIB (or the plugins build dir).

    python3 benchmarks/gpu/attention_op.py [--points 300:512,3000:4096,0:4096:2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="300:512,300:4096,1000:4096,3000:4096,7000:8192,0:4096:128,0:4096:2048",
                    help="comma list of past:capacity[:new tokens]")
    args = ap.parse_args(argv)
    import onnxruntime as ort
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(ROOT / "tests" / "plugins"))
    from test_ort_attention import _feeds, _model

    from enginesmith.plugins import ort_ops

    ort.preload_dlls()
    lib = str(ort_ops.require())
    h, hkv, d = 32, 8, 64
    for point in args.points.split(","):
        past, cap, new = ([int(v) for v in point.split(":")] + [1])[:3]
        feeds = _feeds(np.random.default_rng(0), 1, new, h, hkv, d, cap, [past])
        if new == 1:
            feeds["total_sequence_length"] = np.array(cap, np.int32)
        for ours in (True, False):
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.register_custom_ops_library(lib)
            sess = ort.InferenceSession(_model(ours, h, hkv, d, 0.125).SerializeToString(), opts,
                                        providers=["CUDAExecutionProvider"])
            dev = {k: torch.from_numpy(v).cuda() for k, v in feeds.items() if k != "total_sequence_length"}
            out = torch.empty(1, new, h * d, dtype=torch.float16, device="cuda")
            io = sess.io_binding()
            for k, t in dev.items():
                io.bind_input(k, "cuda", 0, np.float16 if t.dtype == torch.float16 else np.int32, list(t.shape),
                              t.data_ptr())
            io.bind_cpu_input("total_sequence_length", feeds["total_sequence_length"])
            io.bind_output("out", "cuda", 0, np.float16, [1, new, h * d], out.data_ptr())
            for name, src in (("present_key", "past_key"), ("present_value", "past_value")):
                io.bind_output(name, "cuda", 0, np.float16, list(dev[src].shape), dev[src].data_ptr())
            for _ in range(20):
                sess.run_with_iobinding(io)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    sess.run_with_iobinding(io)
                torch.cuda.synchronize()
            rows = sorted(((e.key, e.device_time_total / 20) for e in prof.key_averages() if e.device_time_total > 0),
                          key=lambda r: -r[1])
            total = sum(us for _, us in rows)
            print(f"{'enginesmith' if ours else 'ORT GQA':11s} past={past:5d} capacity={cap:5d} new={new:5d}: "
                  f"{total:8.2f} us GPU  "
                  + "; ".join(f"{us:.2f} {key[:40]}" for key, us in rows[:4]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
