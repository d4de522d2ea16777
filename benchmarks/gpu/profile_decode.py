"""Where a decode step's time goes on ORT CUDA: per-kernel GPU time of one step, and tok/s, for graph
variants x ORT kernel choices (environment variables and CUDA EP options read at session creation).

Each variant runs in its own process (ORT reads the attention-kernel environment once):

    python benchmarks/gpu/profile_decode.py --graphs benchmarks/gpu/graphs --out $OUT/profile.json \
        --variant fp16 --variant fp16:ORT_ENABLE_XQA=1 --variant w4a16lm:ORT_ENABLE_XQA=1:tunable_op_enable=1

A variant is `graph[:KEY=VALUE...]`: upper-case keys are environment variables, others CUDA EP
options. Kernel times come from torch.profiler (CUPTI sees every kernel of the process, ORT's too):
per step = (kernels of a 96-token run - kernels of a 32-token run) / 64, without CUDA graphs; with
the torch-captured graph the same difference gives the GPU busy time of a replayed step, to set
against its wall time (the gaps between kernels).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def parse_variant(text: str) -> tuple[str, dict, dict]:
    graph, *pairs = text.split(":")
    env, options = {}, {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        (env if key.isupper() else options)[key] = value
    return graph, env, options


def _kernels(run) -> dict[str, list[float]]:
    """{kernel name: [count, total us]} of the kernels `run()` launched."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.loads(Path(f.name).read_text())
    out: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in trace.get("traceEvents", []):
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):  # copies and memsets are GPU work too
            row = out[e["name"]]
            row[0] += 1
            row[1] += float(e.get("dur", 0.0))
    return dict(out)


def _per_step(long: dict, short: dict, steps: int) -> list[dict]:
    rows = []
    for name in set(long) | set(short):
        n = (long.get(name, [0, 0])[0] - short.get(name, [0, 0])[0]) / steps
        us = (long.get(name, [0, 0.0])[1] - short.get(name, [0, 0.0])[1]) / steps
        if n > 0 or us > 0.05:
            rows.append({"kernel": name[:160], "per_step": round(n, 2), "us_per_step": round(us, 2)})
    return sorted(rows, key=lambda r: -r["us_per_step"])


def one(path: Path, options: dict, new_tokens: int, reps: int) -> dict:
    sys.path.append(str(ROOT))
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import GqaEngine, fast_generate_ids

    from benchmarks.gpu.bench_gpu import ours

    result: dict = {}

    def gen(engine, n):
        prompts = [list(range(100, 228))]
        return lambda: sum(1 for _ in fast_generate_ids(engine, prompts, GenerationConfig(max_new_tokens=n)))

    for mode in ("torch", "none"):
        t = time.time()
        engine = GqaEngine(path, device="cuda", max_batch=1, capacity=1024, cuda_graph=mode, provider_options=options)
        r = ours(engine, 1, 128, new_tokens, warmup=1, reps=reps)
        r["session_s"] = round(time.time() - t, 1)
        long, short = _kernels(gen(engine, 96)), _kernels(gen(engine, 32))
        rows = _per_step(long, short, 64)
        r["gpu_us_per_step"] = round(sum(x["us_per_step"] for x in rows), 1)
        r["kernels_per_step"] = round(sum(x["per_step"] for x in rows), 1)
        r["top_kernels"] = rows[:30]
        result[mode] = r
        print(f"   {path.stem} {mode}: {r['decode_tok_s']:.1f} tok/s, {r['ms_per_step'] * 1e3:.0f} us/step, "
              f"GPU {r['gpu_us_per_step']} us in {r['kernels_per_step']} kernels", flush=True)
        del engine
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=Path, default=Path(__file__).parent / "graphs")
    ap.add_argument("--variant", action="append", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:  # one variant, in its own process
        graph, _, options = parse_variant(args.child)
        path = graph if graph.endswith(".onnx") else args.graphs / f"{graph}.onnx"
        args.out.write_text(json.dumps(one(Path(path), options, args.new_tokens, args.reps)))
        return 0
    sys.path.append(str(ROOT))
    import torch
    from enginesmith.measure.speed import measure_copy_bandwidth, onnx_weight_bytes

    from benchmarks.gpu import skeleton

    results: dict = {"gpu": torch.cuda.get_device_name(0), "copy_bandwidth_gbs": measure_copy_bandwidth(),
                     "variants": {}}
    print(json.dumps(results), flush=True)
    for graph in {parse_variant(v)[0] for v in args.variant}:
        path = args.graphs / f"{graph}.onnx"
        if not (args.graphs / f"{graph}.onnx.data").exists():
            skeleton.materialize(path)
        results.setdefault("weight_bytes", {})[graph] = onnx_weight_bytes(path)
    for variant in args.variant:
        _, env, _ = parse_variant(variant)
        tmp = args.out.with_suffix(".child.json")
        t = time.time()
        proc = subprocess.run([sys.executable, __file__, "--graphs", str(args.graphs), "--out", str(tmp),
                               "--variant", variant, "--child", variant, "--new-tokens", str(args.new_tokens),
                               "--reps", str(args.reps)], check=False, env=os.environ | env | {
                                   "ORT_ENABLE_ATTENTION_KERNEL_DEBUG_INFO": "1"},
                              capture_output=True, text=True, timeout=300)
        log = proc.stdout + proc.stderr
        entry = json.loads(tmp.read_text()) if proc.returncode == 0 and tmp.exists() else {"error": log[-3000:]}
        entry["attention_kernels"] = sorted({line.split("SdpaKernel=")[1].split()[0]
                                             for line in log.splitlines() if "SdpaKernel=" in line})
        entry["seconds"] = round(time.time() - t, 1)
        results["variants"][variant] = entry
        print(variant, json.dumps(entry)[:400], flush=True)
        for line in log.splitlines():
            if " tok/s" in line:
                print(line, flush=True)
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
