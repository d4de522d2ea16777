"""Quantized KV on the CUDA engines: decode step time at long contexts and perplexity, fp16 against
int8 and fp8 (e4m3) KV, for the paged engine (`build --for-cuda --kv paged --kv-dtype ...`) and the dense
one (`build --for-cuda --custom-attention --kv-dtype ...`).

    python benchmarks/quant/kv_quant_bench.py [--device cuda] [--layouts paged dense] [--contexts 8192 32768]
        [--batches 1 8] [--steps 50] [--ppl-windows 8] [--ppl-window 1024] [--model SPEC] [--speed-model SPEC]
        [--skip-speed] [--skip-ppl]

Engines: the model's fp16 export lowered three times per layout (paged_gqa kv_dtype fp16 | int8 | fp8;
dense: ort_attention, then quantize_kv int8 | fp8; scales calibrated on 8 x 512 tokens of *Emma*, the
same calibration for both layouts), cached under the cache dir.
Dense engines: every row is a full-capacity KV buffer row (capacity = the longest context + steps + 64),
its length set to `context` (the buffer's values do not change the work), and decode steps are the
engine's [B, 1] fixed step (GqaEngine.run_rows: a CUDA graph replay after warm-up); perplexity feeds
each window in one call from an empty row.
Speed: per (context, batch), every row holds `context` tokens in pages spread through the pool (their
values do not change the work), and decode steps (one new token a row) replay the engine's CUDA graph
for the batch bucket; we report the median step time over `steps` steps after warm-up, per KV
format, and the KV bytes one step reads. `--speed-model` (default random:llama-3.2-1b, random weights
at a realistic size; capacity = the longest context) keeps the weights' share of the step realistic.
Perplexity: the first `ppl-windows` x 1024 tokens of *Pride and Prejudice* (no BOS, non-overlapping
windows, each from empty pages), fed in chunks of 16 columns (the op's limit) through the same engine
and pages; real weights only (SmolLM2 by default).
Results go to benchmarks/quant/results/kv_quant_<device>.json (device name included); run the
formats in one process on one GPU so the numbers compare.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FORMATS = ("fp16", "int8", "fp8")
CHUNK = 16  # columns per step: the paged op's max query length (plugins/limits.json)
PAGE = 16


def engines(model: str | None, capacity: int | None, calib_samples: int, layout: str = "paged") -> dict[str, Path]:
    """The three engines of `model` (fp16 export) for `layout` ("paged" | "dense"), built once into the cache dir."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine
    from enginesmith.core.paths import cache_dir

    src = cached_engine(BuildConfig(model=model, dtype="fp16"), progress=True)
    out = {}
    for kv in FORMATS:
        name = f"{src.name}-c{capacity or 'model'}-{kv}" + ("-dense" if layout == "dense" else "")
        path = cache_dir() / "bench" / "kv_quant" / name
        if not (path / "build.json").is_file():
            if layout == "dense":
                build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=capacity, custom_ops=True,
                                  custom_attention=True, kv_dtype=kv, calib_samples=calib_samples), path, source=src,
                                  force=True)
            else:
                build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=capacity, kv_layout="paged",
                                  page_size=PAGE, max_batch=64, kv_dtype=kv, calib_samples=calib_samples), path,
                                  source=src, force=True)
        out[kv] = path
    return out


def decode_speed(path: Path, device: str, context: int, batch: int, steps: int) -> dict:
    """Median decode step time (ms) of `batch` rows at `context` tokens each, through the CUDA graph."""
    import torch

    from enginesmith.runtime.engines.paged_cuda import open_paged_engine

    pages_per_row = -(-(context + steps + 3) // PAGE)  # positions context .. context + steps + 2
    engine = open_paged_engine(path, device=device, max_batch=batch, num_pages=1 + batch * pages_per_row).engine
    rng = np.random.default_rng(0)
    order = rng.permutation(np.arange(1, 1 + batch * pages_per_row)).astype(np.int32)  # pages spread out
    tables = order.reshape(batch, pages_per_row)
    ids = rng.integers(0, engine.vocab, (batch, 1))
    times = []
    for i in range(steps + 3):  # 3 warm-up steps (the bucket's capture happens there)
        pos = context + i
        ctx = np.full(batch, pos + 1, np.int32)
        slots = (tables[:, pos // PAGE] * PAGE + pos % PAGE)[:, None].astype(np.int32)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        with engine._on_stream():
            engine._decode(ids, tables, ctx, slots)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    kv_read = engine.kv_bytes_per_token * context * batch
    del engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"context": context, "batch": batch, "step_ms": 1e3 * float(np.median(times)),
            "kv_bytes_read": int(kv_read)}


def dense_decode_speed(path: Path, device: str, context: int, batch: int, steps: int, capacity: int) -> dict:
    """Median decode step time (ms) of the dense engine, `batch` rows at `context` tokens each."""
    import torch

    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    engine = open_gqa_engine(path, device=device, max_batch=batch, capacity=capacity).engine
    cache = engine.new_cache(batch)
    cache.lengths[:] = context  # rows "hold" context tokens: the buffer's values do not change the work
    ids = np.random.default_rng(0).integers(0, engine.vocab, (batch, 1))
    times = []
    for i in range(steps + 3):  # 3 warm-up steps (the step's capture happens there)
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.run_rows(ids, cache)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    kv_read = engine.kv_bytes_per_token * context * batch
    kv_buffer = int(engine.kv.numel() * engine.kv.element_size())
    del engine, cache
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"context": context, "batch": batch, "step_ms": 1e3 * float(np.median(times)),
            "kv_bytes_read": int(kv_read), "kv_buffer_bytes": kv_buffer}


def dense_perplexity(path: Path, device: str, windows: int, window: int = 1024) -> dict:
    """Perplexity of the dense engine on the first `windows` x `window` tokens of Pride and Prejudice."""
    import torch
    from transformers import AutoTokenizer

    from enginesmith.models.corpus import austen_text, tokenize
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    tokens = tokenize(AutoTokenizer.from_pretrained(str(path / "tokenizer")), austen_text("prideprejudice"),
                      max_tokens=windows * window)
    engine = open_gqa_engine(path, device=device, max_batch=1, capacity=window).engine
    nll, count = 0.0, 0
    for w in range(windows):
        ids = np.asarray(tokens[w * window:(w + 1) * window])
        logits = engine.run_rows(ids[None], engine.new_cache(1))  # an empty row each window
        with engine._on_stream():
            logp = torch.log_softmax(logits[0, :-1].float(), -1).cpu().numpy()
        nll -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
        count += len(ids) - 1
    return {"tokens": count, "windows": windows, "window": window, "ppl": math.exp(nll / count)}


def perplexity(path: Path, device: str, windows: int, window: int = 1024) -> dict:
    """Perplexity of the engine on the first `windows` x `window` tokens of Pride and Prejudice."""
    import torch
    from transformers import AutoTokenizer

    from enginesmith.models.corpus import austen_text, tokenize
    from enginesmith.runtime.engines.paged_cuda import open_paged_engine

    tokens = tokenize(AutoTokenizer.from_pretrained(str(path / "tokenizer")), austen_text("prideprejudice"),
                      max_tokens=windows * window)
    engine = open_paged_engine(path, device=device, max_batch=1, num_pages=2 + window // PAGE).engine
    tables = np.zeros((1, engine.max_blocks), np.int32)
    tables[0, :window // PAGE] = np.arange(1, 1 + window // PAGE)
    nll, count = 0.0, 0
    for w in range(windows):
        ids = tokens[w * window:(w + 1) * window]
        engine.kv.zero_()
        for start in range(0, len(ids), CHUNK):
            pos = np.arange(start, min(start + CHUNK, len(ids)))
            slots = (tables[0, pos // PAGE] * PAGE + pos % PAGE)[None].astype(np.int32)
            with engine._on_stream():
                logits = engine._plain(engine.kv, ids[None, pos], tables, np.array([pos[-1] + 1], np.int32), slots)
            logp = torch.log_softmax(logits[0].float(), -1).cpu().numpy()
            targets = pos + 1 < len(ids)
            nll -= float(logp[np.flatnonzero(targets), ids[pos[targets] + 1]].sum())
            count += int(targets.sum())
    return {"tokens": count, "windows": windows, "window": window, "ppl": math.exp(nll / count)}


def _device_name(device: str) -> str:
    if device != "cuda":
        return platform.processor() or platform.machine()
    import torch

    return torch.cuda.get_device_name(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--layouts", nargs="*", default=["paged", "dense"], choices=["paged", "dense"],
                    help="KV layouts to measure (dense: --custom-attention engines)")
    ap.add_argument("--model", default=None, help="perplexity model (default: SmolLM2)")
    ap.add_argument("--speed-model", default="random:llama-3.2-1b", help="decode-speed model (random weights ok)")
    ap.add_argument("--contexts", type=int, nargs="*", default=[8192, 32768])
    ap.add_argument("--batches", type=int, nargs="*", default=[1, 8])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--ppl-windows", type=int, default=8)
    ap.add_argument("--ppl-window", type=int, default=1024, help="tokens per window (a multiple of 16)")
    ap.add_argument("--calib-samples", type=int, default=8)
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-ppl", action="store_true")
    ap.add_argument("--out", default=None, help="JSON path (default results/kv_quant_<device>.json)")
    args = ap.parse_args()

    result = {"device": _device_name(args.device), "command": " ".join(sys.argv), "formats": list(FORMATS)}
    ppl_of = {"paged": perplexity, "dense": dense_perplexity}
    for layout in args.layouts:
        key = "" if layout == "paged" else "_dense"  # the paged results keep their keys
        if not args.skip_ppl:
            paths = engines(args.model, None, args.calib_samples, layout)
            ppl = {kv: ppl_of[layout](paths[kv], args.device, args.ppl_windows, args.ppl_window) for kv in FORMATS}
            base = ppl["fp16"]["ppl"]
            for kv in FORMATS:
                ppl[kv]["change_pct"] = 100.0 * (ppl[kv]["ppl"] / base - 1.0)
                print(f"{layout} ppl {kv}: {ppl[kv]['ppl']:.4f} ({ppl[kv]['change_pct']:+.3f} %)", flush=True)
            result["perplexity" + key] = {"model": args.model or "SmolLM2-135M-Instruct", **ppl}
        if not args.skip_speed:
            capacity = max(args.contexts) + args.steps + 64
            paths = engines(args.speed_model, capacity, args.calib_samples, layout)
            speed = []
            for context in args.contexts:
                for batch in args.batches:
                    row = {"context": context, "batch": batch}
                    for kv in FORMATS:  # formats side by side on the same warm GPU
                        r = (decode_speed(paths[kv], args.device, context, batch, args.steps) if layout == "paged"
                             else dense_decode_speed(paths[kv], args.device, context, batch, args.steps, capacity))
                        row[kv] = {k: v for k, v in r.items() if k not in ("context", "batch")}
                    for kv in FORMATS[1:]:
                        row[kv]["speedup_vs_fp16"] = row["fp16"]["step_ms"] / row[kv]["step_ms"]
                    print(layout, json.dumps(row), flush=True)
                    speed.append(row)
            result["decode" + key] = {"model": args.speed_model, "layout": layout, "rows": speed}
    out = Path(args.out) if args.out else HERE / "results" / f"kv_quant_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
