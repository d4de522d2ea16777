"""Benchmark the plugin kernels on a GPU (through the ctypes binding, no TensorRT) and write JSON.

  python benchmarks/plugins/bench_plugins.py --out results.json [--quick] [--skip-sparse] [--skip-attention]
      [--reduce single,two] [--contexts 1024,8192] [--batches 1,4] [--sweep-splits [--split-counts 0,16,33]]
      [--no-host-loop]

Paged attention (decode and short multi-token queries): time, max error against torch SDPA on the
same keys/values laid out contiguously, effective bandwidth (KV bytes read / time) as a % of the
measured device copy bandwidth, and SDPA's own time and bandwidth on the contiguous cache.
Sparse GEMM (2:4, fp16): Y = X·Wᵀ for K, N in {2048, 4096, 8192, 14336}, M in {1, 16, 256, 2048}:
dense torch.matmul vs ours (cuSPARSELt's default configuration; with --tune also the fastest
configuration found per shape, M >= 256) vs torch's
to_sparse_semi_structured; the per-shape profitability table goes into the same JSON.
Every figure names the device it was measured on.

Timing: every kernel figure ("ms") is GPU time per call with 20 calls captured in one CUDA graph
and the replays timed with CUDA events, as decode runs in production (TensorRT enqueue, ORT CUDA
graphs); a row's "timing" says "graph", or "eager (capture failed: ...)" if capture failed (also
listed in "graph_capture_failures"). Attention rows also carry the per-call host-loop figure
("ms_host_loop", "pct_of_copy_bw_host_loop": each call launched from Python through ctypes, CUDA
events around the loop, so the host launch path bounds small calls; "host_us_per_call": its host wall
time per launch); --no-host-loop skips it. Their outputs are checked as the timed graph wrote them.

--reduce compares how split-K partials are merged, in one run: `single` (the last block of each
(sequence, KV head) merges them; one kernel, itself a programmatic dependent launch on sm_90),
`two` (a separate reduce kernel, the earlier path), `single-nopdl` (last block, plain launch),
`two-pdl` (reduce kernel, attention kernel as a dependent launch), `auto` (the launcher's default),
`two-prefetch` (two-pdl, the past K/V requested before the dependent-launch wait: valid here, the
previous call's reduce writes only the output), `wkv-two` / `wkv-prefetch` (each call writes the new
tokens' K/V with the write_kv kernel first: the TensorRT plugin's write_kv=1 enqueue before the seventh
session), `fused-two` (the attention kernel writes them itself: the plugin's enqueue now).
Each attention row names its mode (`reduce`); `reduce_comparison` lines the modes up per shape.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_es_plugins_{name}", REPO / "plugins" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


kernels = _load("kernels")
reference = _load("reference")
profitability = _load("profitability")


# Graph captures that failed (and were timed eagerly instead), for the JSON.
CAPTURE_FAILURES: list[str] = []


def _median_event_ms(run, reps: int, samples: int) -> float:
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / reps)
    times.sort()
    return times[len(times) // 2]


def graph_time_ms(fn, reps: int = 20, samples: int = 5):
    """(median per-call GPU time in ms, how it was timed, replay): `reps` calls of fn are captured
    in one CUDA graph (fn launches on torch.cuda.current_stream(), the capture stream) and the graph
    replays are timed with CUDA events, so Python/ctypes launch overhead is not counted -- the way
    decode runs in production (TensorRT enqueue / ORT inside CUDA graphs). `how` is "graph", or
    "eager (capture failed: ...)" when capture failed and the calls were timed as a host loop.
    `replay()` runs the reps calls once more (the graph, or the eager loop).
    fn must not allocate: its outputs and workspaces are preallocated; it is run once before the
    capture (lazy one-time setup, e.g. the kernels' shared-memory attribute) and once on a side stream."""
    fn()
    torch.cuda.synchronize()
    graph, how = None, "graph"
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
    except Exception as exc:  # noqa: BLE001 - fall back to eager launches, and say so (row + JSON)
        how = f"eager (capture failed: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__})"
        print(f"graph capture failed ({exc}); timing eagerly", flush=True)
        CAPTURE_FAILURES.append(how)
        graph = None
        torch.cuda.synchronize()

    def replay():
        if graph is not None:
            graph.replay()
        else:
            for _ in range(reps):
                fn()

    replay()
    torch.cuda.synchronize()
    return _median_event_ms(replay, reps, samples), how, replay


def cuda_time_ms(fn, reps: int = 20, samples: int = 5) -> float:
    """Median per-call GPU time over CUDA-graph replays (graph_time_ms; eager if capture fails)."""
    return graph_time_ms(fn, reps, samples)[0]


def host_loop_time(fn, reps: int = 20, samples: int = 5) -> tuple[float, float]:
    """(ms per call on the GPU clock, host us per call) when each call is launched from Python (ctypes)
    one after another, as the earlier benchmark figure did: CUDA events around `reps` eager calls.
    For small calls the host launch path (Python, ctypes, one or two cudaLaunchKernelEx) bounds it,
    not the kernels. The host figure is wall time per call of the launching loop."""
    fn()
    torch.cuda.synchronize()
    host = []

    def loop():
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        host.append((time.perf_counter() - t) / reps * 1e6)

    loop()
    torch.cuda.synchronize()
    host.clear()
    ms = _median_event_ms(loop, reps, samples)
    host.sort()
    return ms, host[len(host) // 2]


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s: (read + write bytes) / time of a device-to-device copy; the
    best of 256 MiB and 1 GiB buffers (well past L2)."""
    best = 0.0
    for n in (1 << 27, 1 << 29):
        src = torch.empty(n, dtype=torch.float16, device="cuda")
        dst = torch.empty_like(src)
        ms = cuda_time_ms(lambda: dst.copy_(src), reps=10)
        best = max(best, 2 * n * 2 / (ms * 1e-3))
        del src, dst
    torch.cuda.empty_cache()
    return best


def read_bandwidth() -> float:
    """Device read bandwidth in bytes/s: a sum over 2 GiB (for reference beside the copy figure)."""
    n = 1 << 29
    src = torch.ones(n, dtype=torch.float16, device="cuda")
    ms = cuda_time_ms(lambda: src.sum(dtype=torch.float32), reps=5)
    del src
    torch.cuda.empty_cache()
    return n * 2 / (ms * 1e-3)


# --reduce mode -> (kernels.PagedAttention reduce, dependent_launch, prefetch_past, how the new tokens'
# K/V are written: None, "kernel" or "fused"). "wkv-*": each call writes the Sq new tokens' K/V through
# the slot mapping with the write_kv kernel and then runs the attention, timed together (the TensorRT
# plugin's write_kv=1 enqueue until the seventh session); "fused-two": one kernel writes and attends
# (the plugin's enqueue now).
REDUCE_VARIANTS = {
    "auto": ("auto", None, False, None),
    "single": ("single", None, False, None),
    "two": ("two", None, False, None),
    "single-nopdl": ("single", False, False, None),
    "two-pdl": ("two", True, False, None),
    "two-prefetch": ("two", True, True, None),
    "wkv-two": ("two", True, False, "kernel"),
    "wkv-prefetch": ("two", True, True, "kernel"),
    "fused-two": ("two", True, False, "fused"),
}


def time_modes(make_op, run, modes, rounds: int = 2, host_loop: bool = False):
    """Per mode the best of `rounds` median graph-replay times (ms), the modes interleaved so that
    drift on a shared machine hits them alike. Returns (times, ops, info): info[mode] holds "timing"
    (how the graph figure was taken), "replay" (runs the timed calls once more) and, with host_loop,
    "host_loop_ms" / "host_us_per_call" (each call launched from Python; host_loop_time)."""
    ops = {}
    for m in modes:
        reduce, pdl, prefetch, _ = REDUCE_VARIANTS[m]
        ops[m] = make_op(reduce, pdl, prefetch)
    times = {m: float("inf") for m in modes}
    info = {m: {} for m in modes}
    for _ in range(rounds):
        for m in modes:
            op = ops[m]
            fn = lambda op=op, m=m: run(op, m)  # noqa: E731 - bound now: replay() may call it later
            ms, how, replay = graph_time_ms(fn)
            if ms < times[m]:
                times[m] = ms
                info[m].update(timing=how, replay=replay)
            if host_loop:
                hl_ms, host_us = host_loop_time(fn)
                if hl_ms < info[m].get("host_loop_ms", float("inf")):
                    info[m].update(host_loop_ms=hl_ms, host_us_per_call=host_us)
    return times, ops, info


def bench_attention(shape, contexts, batches, query_lens, block_size, copy_bw, dtype=torch.float16, modes=("auto",),
                    host_loop: bool = True):
    H, Hkv, D = shape
    rows = []
    for ctx_len in contexts:
        for B in batches:
            kv_bytes = 2 * B * ctx_len * Hkv * D * 2
            if 2 * kv_bytes > 0.6 * torch.cuda.get_device_properties(0).total_memory:
                continue
            for Sq in query_lens:
                g = torch.Generator().manual_seed(0)
                pages = (ctx_len + block_size - 1) // block_size
                nb = B * pages
                k_cache = torch.randn(nb, block_size, Hkv, D, device="cuda", dtype=dtype)
                v_cache = torch.randn(nb, block_size, Hkv, D, device="cuda", dtype=dtype)
                tables = torch.randperm(nb, generator=g).to(torch.int32).view(B, pages).cuda()
                ctx = torch.full((B,), ctx_len, dtype=torch.int32, device="cuda")
                q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype)
                # Everything the timed calls touch exists before the capture: outputs here, the
                # workspace, split counters and error flag in kernels.PagedAttention.__init__.
                outs = {m: torch.empty_like(q) for m in modes}
                # The "wkv-*" modes' write: the Sq new tokens of each sequence (the last positions).
                # Drawn from the cache's own values there, so every mode sees the same K/V.
                pos = torch.arange(ctx_len - Sq, ctx_len, device="cuda")
                slots = (tables[:, pos // block_size].long() * block_size + pos % block_size).to(torch.int32).reshape(-1)
                new_k = k_cache.view(-1, Hkv, D)[slots.long()].clone()
                new_v = v_cache.view(-1, Hkv, D)[slots.long()].clone()
                wkv_flag = torch.zeros(1, dtype=torch.int32, device="cuda")

                def run(op, m):
                    write = REDUCE_VARIANTS[m][3]
                    if write == "fused":
                        op(q, k_cache, v_cache, tables, ctx, outs[m], new_key=new_k.view(B, Sq, Hkv, D),
                           new_value=new_v.view(B, Sq, Hkv, D), slot_mapping=slots.view(B, Sq))
                        return
                    if write == "kernel":
                        kernels.write_kv(new_k, new_v, slots, k_cache, v_cache, error_flag=wkv_flag)
                    op(q, k_cache, v_cache, tables, ctx, outs[m])

                times, ops, info = time_modes(
                    lambda reduce, pdl, prefetch: kernels.PagedAttention(
                        q, k_cache, v_cache, tables, reduce=reduce, dependent_launch=pdl, prefetch_past=prefetch),
                    run, modes, host_loop=host_loop)
                # The error below is of what the timed graph itself wrote (outputs poisoned first), so
                # a capture that recorded no kernels shows up as NaN.
                for m in modes:
                    outs[m].fill_(float("nan"))
                    info[m]["replay"]()
                torch.cuda.synchronize()
                # Same keys/values, contiguous [B, Hkv, ctx, D], for SDPA (GQA without copying heads).
                kc = k_cache[tables.long()].reshape(B, pages * block_size, Hkv, D)[:, :ctx_len].transpose(1, 2).contiguous()
                vc = v_cache[tables.long()].reshape(B, pages * block_size, Hkv, D)[:, :ctx_len].transpose(1, 2).contiguous()
                qt = q.transpose(1, 2)  # [B, H, Sq, D]
                if Sq == 1:
                    mask = None
                else:  # query token s sees positions <= ctx - Sq + s
                    pos = torch.arange(ctx_len, device="cuda")
                    lim = ctx_len - Sq + torch.arange(Sq, device="cuda")
                    mask = pos[None, :] <= lim[:, None]

                def sdpa():
                    return F.scaled_dot_product_attention(qt, kc, vc, attn_mask=mask, enable_gqa=True)

                ref = sdpa().transpose(1, 2)
                sdpa_ms = cuda_time_ms(sdpa)
                for m in modes:
                    ms = times[m]
                    row = {
                        "H": H, "Hkv": Hkv, "D": D, "block_size": block_size, "dtype": str(dtype).split(".")[-1],
                        "batch": B, "context": ctx_len, "query_len": Sq, "splits": ops[m].splits, "reduce": m,
                        # "ms" is the graph figure (GPU time per call, 20 calls per graph replay).
                        "timing": info[m]["timing"],
                        "ms": round(ms, 5), "kv_bytes": kv_bytes,
                        "bandwidth_GBps": round(kv_bytes / (ms * 1e-3) / 1e9, 1),
                        "pct_of_copy_bw": round(100 * kv_bytes / (ms * 1e-3) / copy_bw, 1),
                    }
                    if "host_loop_ms" in info[m]:  # per call, each launched from Python (ctypes)
                        hl = info[m]["host_loop_ms"]
                        row.update({
                            "ms_host_loop": round(hl, 5),
                            "pct_of_copy_bw_host_loop": round(100 * kv_bytes / (hl * 1e-3) / copy_bw, 1),
                            "host_us_per_call": round(info[m]["host_us_per_call"], 2),
                        })
                    row.update({
                        "max_err_vs_sdpa": (outs[m].float() - ref.float()).abs().max().item(),
                        "max_diff_vs_first_mode": (outs[m].float() - outs[modes[0]].float()).abs().max().item(),
                        "sdpa_ms": round(sdpa_ms, 5),
                        "sdpa_pct_of_copy_bw": round(100 * kv_bytes / (sdpa_ms * 1e-3) / copy_bw, 1),
                        "speedup_vs_sdpa": round(sdpa_ms / ms, 2),
                    })
                    rows.append(row)
                    print(json.dumps(rows[-1]), flush=True)
                del k_cache, v_cache, kc, vc, ops, outs, ref, info
                torch.cuda.empty_cache()
    return rows


def reduce_comparison(rows):
    """One line per shape: each --reduce mode's time and % of copy bandwidth side by side."""
    key = ("H", "Hkv", "D", "block_size", "dtype", "batch", "context", "query_len")
    table = {}
    for r in rows:
        line = table.setdefault(tuple(r[k] for k in key), {k: r[k] for k in key})
        line[f"ms_{r['reduce']}"] = r["ms"]
        line[f"pct_{r['reduce']}"] = r["pct_of_copy_bw"]
        line[f"splits_{r['reduce']}"] = r["splits"]
        if "ms_host_loop" in r:
            line[f"ms_host_loop_{r['reduce']}"] = r["ms_host_loop"]
            line[f"pct_host_loop_{r['reduce']}"] = r["pct_of_copy_bw_host_loop"]
        line["sdpa_ms"] = r["sdpa_ms"]
    lines = list(table.values())
    for line in lines:
        if "ms_single" in line and "ms_two" in line:
            line["speedup_single_vs_two"] = round(line["ms_two"] / line["ms_single"], 3)
    return lines


def sweep_splits(contexts, split_counts, copy_bw, shape=(32, 8, 128), block_size=16, dtype=torch.float16,
                 modes=("auto",)):
    """Batch-1 decode time per forced split count (0 = the launcher's own choice) and --reduce mode:
    where the fixed cost (launch, pipeline fill, the split merge) meets the streaming time."""
    H, Hkv, D = shape
    rows = []
    for ctx_len in contexts:
        pages = (ctx_len + block_size - 1) // block_size
        k_cache = torch.randn(pages, block_size, Hkv, D, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        tables = torch.arange(pages, dtype=torch.int32, device="cuda")[None]
        ctx = torch.full((1,), ctx_len, dtype=torch.int32, device="cuda")
        q = torch.randn(1, 1, H, D, device="cuda", dtype=dtype)
        kv_bytes = 2 * ctx_len * Hkv * D * 2
        out = torch.empty_like(q)
        for splits in split_counts:
            times, ops, info = time_modes(
                lambda reduce, pdl, prefetch: kernels.PagedAttention(q, k_cache, v_cache, tables, num_splits=splits,
                                                                     reduce=reduce, dependent_launch=pdl,
                                                                     prefetch_past=prefetch),
                lambda op, m: op(q, k_cache, v_cache, tables, ctx, out), modes)
            for m in modes:
                ms = times[m]
                rows.append({"context": ctx_len, "requested_splits": splits, "splits": ops[m].splits, "reduce": m,
                             "timing": info[m]["timing"], "ms": round(ms, 5), "pct_of_copy_bw": round(100 * kv_bytes / (ms * 1e-3) / copy_bw, 1)})
                print(json.dumps(rows[-1]), flush=True)
        del k_cache, v_cache
        torch.cuda.empty_cache()
    return rows


def _make_24(n, k):
    w = torch.randn(n, k, device="cuda", dtype=torch.float16)
    return reference.prune_24_magnitude(w)


def run_probe(what: str, m: int) -> None:
    """Child-process body: one call that might leave the CUDA context unusable."""
    x = torch.randn(m, 2048, device="cuda", dtype=torch.float16)
    w = _make_24(2048, 2048)
    from torch.sparse import to_sparse_semi_structured

    F.linear(x, to_sparse_semi_structured(w))
    torch.cuda.synchronize()


def tune_choices(g, ms) -> list[tuple[int, int]]:
    """Every (M, config id) the search tries, in a fixed order (split-K: refused on an H100)."""
    return [(m, c) for m in ms for c in range(g.algorithm_count(m))]


def run_tune_child(k: int, n: int, ms: list[int], skip: int) -> None:
    """Child-process body of the algorithm search: time each choice after the first `skip`, one JSON
    line each (flushed, so the parent keeps what came before a choice that breaks the context)."""
    torch.manual_seed(0)
    g = kernels.SparseGemm24(_make_24(n, k))
    xs = {m: torch.randn(m, k, device="cuda", dtype=torch.float16) for m in ms}
    ys = {m: torch.empty(m, n, device="cuda", dtype=torch.float16) for m in ms}
    for i, (m, c) in enumerate(tune_choices(g, ms)):
        if i < skip:
            continue
        try:
            g.config = c
            g(xs[m], ys[m])
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                g(xs[m], ys[m])
            stop.record()
            torch.cuda.synchronize()
            print(json.dumps({"i": i, "M": m, "config": c, "ms": start.elapsed_time(stop) / 10}), flush=True)
        except kernels.KernelError as exc:  # refused (not a crash): record and go on
            print(json.dumps({"i": i, "M": m, "config": c, "error": str(exc)[:200]}), flush=True)


def search_algorithms(k: int, n: int, ms: list[int]) -> dict:
    """Per M, the fastest of cuSPARSELt's kernel configurations, each tried in a child
    process (cusparseLtMatmulSearch broke the CUDA context on an H200; a choice that does so here
    kills only its child, is recorded, and the search goes on after it)."""
    done, crashed, skip = {}, [], 0
    for _ in range(8):
        proc = subprocess.run([sys.executable, __file__, "--probe", "tune", "--probe-k", str(k), "--probe-n", str(n),
                               "--probe-ms", ",".join(map(str, ms)), "--probe-skip", str(skip), "--out", "/dev/null"],
                              capture_output=True, text=True, timeout=300)
        lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        for r in lines:
            done[r["i"]] = r
        if proc.returncode == 0:
            break
        print(f"tune child K={k} N={n} exit {proc.returncode}: {proc.stderr.strip()[-300:]}", flush=True)
        last = max(done) if done else skip - 1
        crashed.append(last + 1)  # the choice after the last one reported broke the child
        skip = last + 2
    best = {}
    for r in done.values():
        if "ms" in r and (r["M"] not in best or r["ms"] < best[r["M"]]["ms"]):
            best[r["M"]] = r
    return {"best": best, "tried": len(done), "crashed": crashed}


def probe(what: str, m: int) -> str | None:
    """None if `what` (torch) runs at this M in a fresh process, else why it failed."""
    proc = subprocess.run([sys.executable, __file__, "--probe", what, "--probe-m", str(m), "--out", "/dev/null"],
                          capture_output=True, text=True, timeout=180)
    if proc.returncode == 0:
        return None
    lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if "Error" in ln or "error" in ln]
    return (lines or ["exit code " + str(proc.returncode)])[-1][:300]


def bench_sparse(sizes, ms_list, tune: bool):
    from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured

    # Some paths crash the CUDA context at small M (seen: an illegal instruction at M=1); find out in a
    # child process first so one crash does not end the run.
    broken = {("torch", m): probe("torch", m) for m in ms_list if m < 256}
    for key, why in broken.items():
        if why:
            print(f"probe {key}: {why}", flush=True)
    rows = []
    for K in sizes:
        for N in sizes:
            torch.manual_seed(0)
            w = _make_24(N, K)
            ours = kernels.SparseGemm24(w)
            try:
                w_torch = to_sparse_semi_structured(w)
                torch_backend = "cutlass" if SparseSemiStructuredTensor._FORCE_CUTLASS else "cusparselt"
            except Exception as exc:  # noqa: BLE001 - record why torch's path is missing
                w_torch, torch_backend = None, f"unavailable: {exc}"
            search = search_algorithms(K, N, [m for m in ms_list if m >= 256]) if tune else None
            if search:
                print(f"K={K} N={N}: {search['tried']} choices tried, crashed: {search['crashed']}", flush=True)
            for M in ms_list:
                x = torch.randn(M, K, device="cuda", dtype=torch.float16)
                y = torch.empty(M, N, device="cuda", dtype=torch.float16)
                wt = w.t()
                dense_ms = cuda_time_ms(lambda: torch.matmul(x, wt, out=y))
                ours_ms = cuda_time_ms(lambda: ours(x, y))
                ref = x.float() @ w.float().t()
                rel_err = ((ours(x).float() - ref).abs().max() / ref.abs().max()).item()
                tuned_ms, tuned, tuned_err = None, None, None
                if search and M in search["best"]:
                    tuned = search["best"][M]
                    ours.config = tuned["config"]
                    tuned_ms = cuda_time_ms(lambda: ours(x, y))
                    tuned_err = ((ours(x).float() - ref).abs().max() / ref.abs().max()).item()
                    ours.config = -1  # back to cuSPARSELt's default selection
                torch_ms = None
                if w_torch is not None and not broken.get(("torch", M)):
                    try:
                        torch_ms = cuda_time_ms(lambda: F.linear(x, w_torch))
                    except Exception as exc:  # noqa: BLE001
                        print(f"torch semi-structured failed K={K} N={N} M={M}: {exc}", flush=True)
                rows.append({
                    "K": K, "N": N, "M": M,
                    "dense_ms": round(dense_ms, 5), "ours_ms": round(ours_ms, 5),
                    "ours_tuned_ms": None if tuned_ms is None else round(tuned_ms, 5),
                    "tuned_config": None if tuned is None else tuned["config"],
                    "torch_semi_structured_ms": None if torch_ms is None else round(torch_ms, 5),
                    "torch_backend": torch_backend,
                    # The default configuration: what SparseGemm24 and the plugin run.
                    "speedup_vs_dense": round(dense_ms / ours_ms, 3),
                    "speedup_tuned_vs_dense": None if tuned_ms is None else round(dense_ms / tuned_ms, 3),
                    "speedup_vs_torch_sparse": None if torch_ms is None else round(torch_ms / ours_ms, 3),
                    "max_rel_err": rel_err,
                    "max_rel_err_tuned": tuned_err,
                    "skipped": {k: v for k, v in (("torch", broken.get(("torch", M))),) if v},
                })
                print(json.dumps(rows[-1]), flush=True)
            del ours, w, w_torch
            torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="JSON file to write")
    ap.add_argument("--quick", action="store_true", help="a few shapes only")
    ap.add_argument("--decode-only", action="store_true", help="attention: the Llama-shaped decode grid only")
    ap.add_argument("--skip-sparse", action="store_true")
    ap.add_argument("--skip-attention", action="store_true")
    ap.add_argument("--sweep-splits", action="store_true", help="attention: batch-1 time per forced split count")
    ap.add_argument("--split-counts", default="0,8,16,24,33,48,66,99,132",
                    help="--sweep-splits: split counts to force (0 = the launcher's choice)")
    ap.add_argument("--reduce", default="auto",
                    help="attention: comma-separated split-merge modes to time side by side: "
                         + ", ".join(REDUCE_VARIANTS) + " (see the module doc)")
    ap.add_argument("--contexts", help="decode grid: comma-separated context lengths (default 1k-32k)")
    ap.add_argument("--batches", help="decode grid: comma-separated batch sizes (default 1,4,16,64)")
    ap.add_argument("--block-sizes", default="16", help="decode grid: comma-separated page sizes (16, 32, 64)")
    ap.add_argument("--no-host-loop", action="store_true",
                    help="attention: skip the per-call host-loop figure (ms_host_loop); the graph figure (ms) is always taken")
    ap.add_argument("--tune", action="store_true",
                    help="sparse: also search cuSPARSELt's kernel configurations for M >= 256 (each "
                         "shape in child processes; a choice that breaks the CUDA context is recorded and skipped)")
    ap.add_argument("--probe", choices=["torch", "tune"], help=argparse.SUPPRESS)
    ap.add_argument("--probe-m", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--probe-k", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--probe-n", type=int, default=2048, help=argparse.SUPPRESS)
    ap.add_argument("--probe-ms", default="256", help=argparse.SUPPRESS)
    ap.add_argument("--probe-skip", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.probe == "tune":
        run_tune_child(args.probe_k, args.probe_n, [int(m) for m in args.probe_ms.split(",")], args.probe_skip)
        return
    if args.probe:
        run_probe(args.probe, args.probe_m)
        return

    modes = tuple(m.strip() for m in args.reduce.split(",") if m.strip())
    bad = [m for m in modes if m not in REDUCE_VARIANTS]
    if bad or not modes:
        ap.error(f"--reduce: unknown mode(s) {bad}; choose from {', '.join(REDUCE_VARIANTS)}")

    props = torch.cuda.get_device_properties(0)
    result = {
        "reduce_modes": list(modes),
        "timing": {
            "ms": "GPU time per call: 20 calls captured in one CUDA graph, median of 5 replays timed with CUDA "
                  "events (best of 2 rounds for attention); a row's 'timing' says 'graph' or why it fell back to eager",
            "ms_host_loop": "per call when each call is launched from Python (ctypes) in a loop, CUDA events around "
                            "20 calls (host launch path included); host_us_per_call: host wall time per launch",
        },
        "ES_PAGED_ATTENTION_REDUCE": os.environ.get("ES_PAGED_ATTENTION_REDUCE"),
        "sparse_layout": os.environ.get("ES_SPARSE_LAYOUT", "row"),
        "kernels_lib": str(kernels.library_path()),
        "command": " ".join(sys.argv),
        "device": props.name, "sm": f"{props.major}{props.minor}", "sms": props.multi_processor_count,
        "torch": torch.__version__, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    t0 = time.time()
    copy_bw = copy_bandwidth()
    result["copy_bandwidth_GBps"] = round(copy_bw / 1e9, 1)
    result["read_bandwidth_GBps"] = round(read_bandwidth() / 1e9, 1)
    print(f"device {props.name}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)

    if args.sweep_splits:
        counts = [int(x) for x in args.split_counts.split(",")]
        result["split_sweep"] = sweep_splits([1024, 8192, 16384, 32768], counts, copy_bw, modes=modes)
    if not args.skip_attention:
        contexts = [1024, 8192] if args.quick else [1024, 2048, 4096, 8192, 16384, 32768]
        batches = [1, 16] if args.quick else [1, 4, 16, 64]
        if args.contexts:
            contexts = [int(x) for x in args.contexts.split(",")]
        if args.batches:
            batches = [int(x) for x in args.batches.split(",")]
        rows = []
        for block_size in (int(x) for x in args.block_sizes.split(",")):
            rows += bench_attention((32, 8, 128), contexts, batches, [1], block_size, copy_bw, modes=modes,
                                    host_loop=not args.no_host_loop)
        if not args.quick and not args.decode_only:
            rows += bench_attention((32, 8, 128), [1024, 8192, 32768], [1, 16], [4, 16], 16, copy_bw, modes=modes,
                                   host_loop=not args.no_host_loop)
            rows += bench_attention((32, 8, 128), [8192, 32768], [1, 16], [1], 64, copy_bw, modes=modes,
                                   host_loop=not args.no_host_loop)
            rows += bench_attention((9, 3, 64), [1024, 8192, 32768], [1, 16, 64], [1], 16, copy_bw, modes=modes,
                                   host_loop=not args.no_host_loop)
        result["paged_attention"] = rows
        result["reduce_comparison"] = reduce_comparison(rows)
    if not args.skip_sparse:
        sizes = [2048, 8192] if args.quick else [2048, 4096, 8192, 14336]
        rows = bench_sparse(sizes, [1, 16, 256, 2048], tune=args.tune)
        result["sparse_gemm"] = rows
        result["sparse_profitability"] = profitability.table_from_benchmark(rows, props.name)
    result["graph_capture_failures"] = CAPTURE_FAILURES
    if CAPTURE_FAILURES:
        print(f"WARNING: {len(CAPTURE_FAILURES)} graph capture(s) failed; those figures are eager", flush=True)
    if result.get("reduce_comparison"):  # a compact table at the end of the log
        print("attention, per call: graph = GPU time in a CUDA graph (20 calls per replay); "
              "host loop = each call launched from Python; % = of copy bandwidth", flush=True)
    for line in result.get("reduce_comparison", []):
        cells = []
        for m in modes:
            cell = f"{m} graph {line[f'ms_{m}'] * 1e3:.1f}us {line[f'pct_{m}']}%"
            if f"ms_host_loop_{m}" in line:
                cell += f" | host loop {line[f'ms_host_loop_{m}'] * 1e3:.1f}us {line[f'pct_host_loop_{m}']}%"
            cells.append(cell)
        print("B={batch} ctx={context} Sq={query_len} D={D} BS={block_size} splits={s}: ".format(
            s=line[f"splits_{modes[0]}"], **line) + "   ".join(cells) + f"   sdpa graph {line['sdpa_ms'] * 1e3:.1f}us",
            flush=True)
    result["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out} in {result['seconds']} s", flush=True)


if __name__ == "__main__":
    main()
