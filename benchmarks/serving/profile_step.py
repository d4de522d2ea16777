"""Where a decode step of the CUDA paged engine spends its time, at batch B (issue 18: the batch-64 decode
step took 9.2 ms on an H100 where weights + KV bound it near 1.3 ms; this finds out why).

For each batch: B requests of --prompt tokens are prefilled through the ContinuousBatcher, then --steps
decode steps are timed, with sync scheduling and then async (one step in flight while the host prepares
the next): the whole `batcher.step()` (wall), the engine's `run` alone (sync only: wall, host work
included), the host time inside `launch`, and the GPU time of what a step queues (CUDA events); plus
async's speed-up per step. Then one decode step without CUDA graphs runs under torch.profiler: the top
kernels by GPU time.

    python3 benchmarks/serving/profile_step.py --engine /tmp/e/fp16 --batch 1,16,64 --json-out $OUT/profile.json
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.engines.paged_cuda import PagedCudaEngine, open_paged_engine


def _prefilled(engine, batch: int, prompt: int, new: int, async_steps: bool | None = None) -> ContinuousBatcher:
    rng = np.random.default_rng(0)
    b = ContinuousBatcher(engine, SchedulerConfig(max_batch=batch, max_tokens=batch * 16, chunk=16,
                                                  async_steps=async_steps), enable_prefix_caching=False)
    for _ in range(batch):
        b.add_request(rng.integers(0, 32000, prompt).tolist(), new)
    while b.waiting or any(not r.output for r in b.running):  # until every request decodes
        b.step()
    return b


def _timed(engine, batch: int, prompt: int, steps: int, async_steps: bool) -> dict:
    """Median wall time of a decode step() (sync: host and GPU one after the other; async: the host work
    for step n+1 beside the GPU's step n, so ~ max of the two), the GPU time of a step (CUDA events
    around everything `launch` queues: input copies, graph, sampling, token readback), and the host
    time inside `launch` (staging and queuing) and, sync only, inside `run` (launch + the wait)."""
    b = _prefilled(engine, batch, prompt, steps + 8, async_steps)
    launch_s, run_s, events, step_s = [], [], [], []
    inner_launch, inner_run = engine.launch, engine.run

    def timed_launch(ids, step, picks):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(engine.stream)
        t0 = time.perf_counter()
        pending = inner_launch(ids, step, picks)
        launch_s.append(time.perf_counter() - t0)
        end.record(engine.stream)
        events.append((start, end))  # read after the loop: a sync here would serialize the async steps
        return pending

    def timed_run(ids, step, picks):  # sync scheduling calls run (which calls launch)
        t0 = time.perf_counter()
        out = inner_run(ids, step, picks)
        run_s.append(time.perf_counter() - t0)
        return out

    engine.launch, engine.run = timed_launch, timed_run
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            out = b.step()
            step_s.append(time.perf_counter() - t0)
            assert out.width == 1 and len(out.scheduled) == batch
    finally:
        del engine.launch, engine.run  # the class's methods again
        b.close()
    torch.cuda.synchronize()
    gpu_ms = [start.elapsed_time(end) for start, end in events]
    row = {"batch": batch, "async_steps": async_steps, "step_ms": 1e3 * float(np.median(step_s)),
           "gpu_ms": float(np.median(gpu_ms)), "launch_ms": 1e3 * float(np.median(launch_s))}
    if run_s:
        row["run_ms"] = 1e3 * float(np.median(run_s))
        row["scheduler_ms"] = row["step_ms"] - row["run_ms"]  # host work outside the engine, serialized
    return row


def _both(engine, batch: int, prompt: int, steps: int) -> dict:
    """Sync then async scheduling on the same engine: the step's wall time and the speed-up."""
    sync, overlapped = (_timed(engine, batch, prompt, steps, mode) for mode in (False, True))
    return {**sync, "async": overlapped, "async_speedup": sync["step_ms"] / overlapped["step_ms"]}


def _kernels(path: str, batch: int, prompt: int, top: int = 15, graph: bool = False) -> list[dict]:
    engine = PagedCudaEngine(f"{path}/model.onnx", device="cuda", max_batch=batch, num_pages=batch * 80 + 8,
                             cuda_graph=graph)
    b = _prefilled(engine, batch, prompt, 16, async_steps=False)  # a profile of one step alone
    b.step()
    b.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        b.step()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append({"kernel": e.key[:90], "calls": e.count, "us": round(t, 1)})
    return sorted(rows, key=lambda r: -r["us"])[:top]


def _gemm_floor(batches: list[int], hidden: int = 2048, inter: int = 8192, vocab: int = 128256,
                kv: int = 512) -> list[dict]:
    """cuBLAS fp16 x[M, K] @ W[N, K]^T through torch at each M over the 1B shapes: GB/s of the weight read
    (what the engine's GEMMs could reach)."""
    out = []
    for n, k in ((hidden + 2 * kv, hidden), (hidden, hidden), (inter, hidden), (hidden, inter), (vocab, hidden)):
        w = torch.randn(n, k, device="cuda", dtype=torch.float16)
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            for _ in range(3):
                x @ w.T
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                x @ w.T
            end.record()
            end.synchronize()
            us = start.elapsed_time(end) * 1e3 / 20
            out.append({"M": m, "N": n, "K": k, "us": round(us, 1), "GB/s": round(2 * n * k / us / 1e3, 1)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", required=True)
    ap.add_argument("--batch", default="1,16,64")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--timed-only", action="store_true", help="skip the kernel tables and the GEMM floor")
    args = ap.parse_args()
    batches = [int(x) for x in args.batch.split(",")]
    loaded = open_paged_engine(args.engine, device="cuda", max_batch=max(batches),
                               num_pages=max(batches) * 80 + 8)
    result = {"device": torch.cuda.get_device_name(), "engine": args.engine,
              "timed": [_both(loaded.engine, b, args.prompt, args.steps) for b in batches]}
    del loaded
    torch.cuda.empty_cache()
    if args.timed_only:
        print(json.dumps(result, indent=1))
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump(result, f)
        return
    result["kernels_no_graph"] = {b: _kernels(args.engine, b, args.prompt) for b in (batches[0], batches[-1])}
    result["kernels_graph"] = {b: _kernels(args.engine, b, args.prompt, graph=True) for b in (batches[-1],)}
    result["gemm_floor"] = _gemm_floor(batches)
    print(json.dumps(result, indent=1))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
