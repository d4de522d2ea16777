"""Ours vs ONNX Runtime GenAI, interleaved: each GenAI run sits between two of ours in one session
(the H200 machines drift by several percent within a session, so one run each is not a verdict).

Order: ours fp16 | GenAI fp16 (its defaults) | GenAI fp16 with ORT_ENABLE_XQA=0 (the GQA decode
kernel our engine selects) | ours fp16 | ours W4A16 | GenAI int4 | ours W4A16. Batch 1, prompt 128,
256 greedy tokens, CUDA graphs everywhere, decode tok/s as bench_gpu.py defines it.

    python3 benchmarks/gpu/peer_bracket.py --genai-script benchmarks/gpu/graphs/ortgenai_bench.py --out $OUT/bracket.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graphs", type=Path, default=Path(__file__).parent / "graphs")
    ap.add_argument("--genai-script", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/gpu_bench"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.append(str(ROOT))
    import torch

    from benchmarks.gpu import skeleton
    from benchmarks.gpu.bench_gpu import _free, ours
    from enginesmith.runtime.engines.ort_cuda import GqaEngine

    work = args.work / "genai"
    work.mkdir(parents=True, exist_ok=True)
    build = subprocess.Popen([sys.executable, str(args.genai_script), "--size", "1b", "--ep", "cuda", "--work",
                              str(work), "--phase", "build"], stdout=open(args.work / "genai_build.log", "w"),
                             stderr=subprocess.STDOUT)
    for name in ("fp16", "w4a16lm"):
        if not (args.graphs / f"llama1b_{name}.onnx.data").exists():
            skeleton.materialize(args.graphs / f"llama1b_{name}.onnx")
    build.wait()
    rows: list[dict] = []
    result = {"gpu": torch.cuda.get_device_name(0), "order": rows}

    def mine(name: str) -> None:
        engine = GqaEngine(args.graphs / f"llama1b_{name}.onnx", device="cuda", max_batch=1, capacity=512)
        r = ours(engine, 1, 128, 256, warmup=2, reps=args.reps)
        rows.append({"system": "enginesmith", "variant": name, "decode_tok_s": r["decode_tok_s"],
                     "ms_per_token": r["ms_per_step"]})
        del engine
        _free()

    def genai(precision: str, env: dict) -> None:
        jsonl = args.work / f"genai_{len(rows)}.jsonl"
        subprocess.run([sys.executable, str(args.genai_script), "--size", "1b", "--ep", "cuda", "--work", str(work),
                        "--phase", "bench", "--precisions", precision, "--cuda-graph", "on", "--reps",
                        str(args.reps), "--warmup", "1", "--json-out", str(jsonl)], env=os.environ | env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, timeout=300, check=False)
        for line in jsonl.read_text().splitlines() if jsonl.exists() else []:
            r = json.loads(line)
            rows.append({"system": "ort-genai", "variant": r["variant"], "env": env,
                         "decode_tok_s": r["decode_tok_s"], "ms_per_token": r["ms_per_tok"]})

    steps = [lambda: mine("fp16"), lambda: genai("fp16", {}), lambda: genai("fp16", {"ORT_ENABLE_XQA": "0"}),
             lambda: mine("fp16"), lambda: mine("w4a16lm"), lambda: genai("int4", {}), lambda: mine("w4a16lm")]
    for step in steps:
        t = time.time()
        step()
        print(json.dumps(rows[-1]) if rows else "(no result)", f"{time.time() - t:.0f} s", flush=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
