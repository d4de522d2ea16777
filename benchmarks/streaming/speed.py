"""Per-token cost at window 1024 (sinks + window): the ring cache (StreamingLLM) vs sliding window with re-computation.

    python benchmarks/streaming/speed.py --device cpu --out DIR [--threads N]
    python benchmarks/streaming/speed.py --device cuda --out DIR

Same process, same engine build, same text (Pride and Prejudice):
- ring: a 4 + 1020 ring cache kept full, then --steps decode steps (median ms per token);
- recompute: one forward over the previous 1023 tokens per generated token, through a copy of the
  dense graph that returns only the last position's logits (median of --windows forwards);
- dense: a decode step of the ordinary growing cache at 1024 tokens of context, for reference;
- parity: ring vs dense logits over the first 64 tokens (no eviction yet), on this device.
Writes speed_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from enginesmith.measure import streaming
from enginesmith.models import corpus  # noqa: E402
from enginesmith.runtime.engines.ort_engine import OrtEngine  # noqa: E402


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--text", default=None)
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--kv-window", type=int, default=1020)
    p.add_argument("--out", default="benchmarks/streaming/results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        common.strict_fp32_cuda()
    dense = common.open_engine(args.model, args.device, threads=args.threads)
    ring = common.open_engine(args.model, args.device, "ring", args.sinks, args.kv_window, threads=args.threads).engine
    cap = args.sinks + args.kv_window
    ids = corpus.tokenize(dense.tokenizer, corpus.load_text(args.text), cap + args.steps + 64)
    one = np.ones((1, 1), np.int64)

    # parity before eviction, on this device
    first = ids[None, :64]
    expected = dense.engine.forward(first, np.ones_like(first), np.arange(64)[None], dense.engine.new_cache(1))
    got = ring.forward(first, np.ones_like(first), np.zeros_like(first), ring.new_cache(1))
    parity = float(np.abs(got - expected).max())

    cache = ring.new_cache(1)
    w = args.kv_window
    ring.forward(ids[None, :w], np.ones((1, w), np.int64), np.zeros((1, w), np.int64), cache)
    for t in range(w, cap + 8):  # full, and evicting
        ring.forward(ids[None, t:t + 1], one, one, cache)
    step = iter(range(cap + 8, cap + 8 + args.steps + 4))
    ring_ms = timed(lambda: ring.forward(ids[None, (t := next(step)):t + 1], one, one, cache), args.steps)

    dcache = dense.engine.new_cache(1)
    dense.engine.forward(ids[None, :cap], np.ones((1, cap), np.int64), np.arange(cap)[None], dcache)
    length = [cap]

    def dense_step():
        t = length[0]
        dense.engine.forward(ids[None, t:t + 1], np.ones((1, t + 1), np.int64), np.array([[t]]), dcache)
        length[0] += 1

    dense_ms = timed(dense_step, min(args.steps, 30))

    last = OrtEngine(streaming.last_token_graph(dense.path / "model.onnx", out / "last_token.onnx"),
                     device=args.device, threads=args.threads)
    window = ids[None, :cap - 1]
    recompute_ms = timed(lambda: last.forward(window, np.ones_like(window), np.arange(cap - 1)[None], last.new_cache(1)),
                         args.windows)
    for f in (out / "last_token.onnx", out / "last_token.onnx.data"):
        f.unlink(missing_ok=True)
    result = {"device": common.device_name(args.device), "model": args.model or "SmolLM2-135M-Instruct",
              "threads": args.threads, "sinks": args.sinks, "window": args.kv_window, "capacity": cap,
              "ring_ms_per_token": round(ring_ms, 2), "recompute_ms_per_token": round(recompute_ms, 2),
              "dense_decode_at_capacity_ms_per_token": round(dense_ms, 2),
              "recompute_over_ring": round(recompute_ms / ring_ms, 1),
              "ring_vs_dense_max_abs_logit_diff_64_tokens": parity,
              "ring_cache_mib": round(cache.nbytes() / 2**20, 2)}
    (out / f"speed_{args.device}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
