"""Where a batch-1 decode step of an engine directory spends its GPU time (issue 30's kernel table).

The engine is opened as `enginesmith bench --device cuda` opens it (runtime.load's GQA branch), once with
CUDA graphs replayed as bench runs it and once without. For each, a 128-token prompt is followed by 96 and
by 32 greedy tokens under torch.profiler (CUPTI sees ORT's kernels and the ops library's); per step =
(kernels of the 96-token run - kernels of the 32-token run) / 64, as profile_decode.py does for bare
graphs. Reported per mode: tok/s and ms per step of plain timed runs, the GPU busy time of a step, the
kernels per step, and the top kernels. With graphs, the step's wall time minus its GPU busy time is the
gaps between kernels (launch latency inside the replay and the host's per-token work).

The kernel table comes from a second session opened with programmatic dependent launches off
(ES_ORT_OPS_PDL=0, read at session creation): with them on, a kernel starts before its predecessor ends
and waits, so the profiler's durations overlap and their sum exceeds the step (session 18, H200: 1,685 us
of kernels in a 922 us step). The timed runs keep the default (PDL on).

    python3 benchmarks/gpu/decode_kernels.py --engine /tmp/verify/engines/dense_fp16 --out $OUT/kernels.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # appended: an installed enginesmith (PYTHONPATH) stays ahead of the checkout's

from benchmarks.gpu.profile_decode import _kernels, _per_step  # noqa: E402

PROMPT = list(range(100, 228))  # 128 tokens


def _generate(engine, new_tokens: int) -> int:
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids

    return sum(1 for _ in fast_generate_ids(engine, [PROMPT], GenerationConfig(max_new_tokens=new_tokens)))


def one_mode(engine_dir: str, graph: bool, reps: int) -> dict:
    """Timed runs, then the kernel table, of one engine session (graphs on or off)."""
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    loaded = open_gqa_engine(engine_dir, device="cuda", max_batch=1, cuda_graph=graph)
    engine = loaded.engine
    _generate(engine, 32)  # warm-up: the session's first run, the graph capture
    walls = []
    for _ in range(reps):  # ms per step: (256 tokens - 32 tokens) / 224, the prompt cancels out
        t0 = time.perf_counter()
        _generate(engine, 256)
        t1 = time.perf_counter()
        _generate(engine, 32)
        walls.append(((t1 - t0) - (time.perf_counter() - t1)) / 224)
    step_ms = 1e3 * sorted(walls)[len(walls) // 2]
    del engine, loaded
    before = os.environ.get("ES_ORT_OPS_PDL")
    os.environ["ES_ORT_OPS_PDL"] = "0"  # durations that do not overlap (see above)
    try:
        engine = open_gqa_engine(engine_dir, device="cuda", max_batch=1, cuda_graph=graph).engine
    finally:
        if before is None:
            os.environ.pop("ES_ORT_OPS_PDL")
        else:
            os.environ["ES_ORT_OPS_PDL"] = before
    _generate(engine, 32)
    long, short = _kernels(lambda: _generate(engine, 96)), _kernels(lambda: _generate(engine, 32))
    rows = _per_step(long, short, 64)
    gpu_us = sum(r["us_per_step"] for r in rows)
    return {"cuda_graph": graph, "ms_per_step": round(step_ms, 4), "tok_s": round(1e3 / step_ms, 1),
            "gpu_us_per_step_no_pdl": round(gpu_us, 1), "pdl_in_the_table": False,
            "gaps_us_per_step": round(1e3 * step_ms - gpu_us, 1),
            "kernels_per_step": round(sum(r["per_step"] for r in rows), 1), "top_kernels": rows[:25]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True, help="an engine directory built with --for-cuda (dense KV)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    import torch

    result = {"gpu": torch.cuda.get_device_name(0), "engine": args.engine,
              "modes": [one_mode(args.engine, graph, args.reps) for graph in (True, False)]}
    for m in result["modes"]:
        print(f"graphs {'on ' if m['cuda_graph'] else 'off'}: {m['tok_s']} tok/s, {m['ms_per_step']} ms/step, GPU "
              f"{m['gpu_us_per_step_no_pdl']} us (PDL off) in {m['kernels_per_step']} kernels, gaps {m['gaps_us_per_step']} us",
              flush=True)
        for r in m["top_kernels"][:12]:
            print(f"    {r['us_per_step']:8.2f} us  x{r['per_step']:<5} {r['kernel'][:100]}")
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
