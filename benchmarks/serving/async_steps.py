"""Issue 18's async scheduling, sync against async on one machine: wall time per decode step of the
ContinuousBatcher over a model whose step is a GIL-free sleep (FakePagedModel, standing for the GPU) or
over the tiny paged CPU engine (ONNX Runtime, OrtPagedModel).

    --model fake   B requests of P prompt tokens decode T tokens each; every step sleeps --step-ms; the
                   host work (scheduling, inputs, token processing) is real. Sync: a step costs
                   host + sleep; async: ~ max(host, sleep).
    --model cpu    the same closed loop over tiny:llama's paged ORT graph (a measure of whether the
                   CPU engine gains: ORT's threads and the scheduler share the cores)

Reported per mode: the median wall time of a step() at full batch (decode only), and the whole run's
output tok/s; both modes must give every request the same tokens.

    python3 benchmarks/serving/async_steps.py --model fake --step-ms 2.5 --batch 64
    python3 benchmarks/serving/async_steps.py --model cpu --batch 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig  # noqa: E402
from enginesmith.runtime.decoding.sampling import SamplingParams  # noqa: E402


def make_model(args):
    if args.model == "fake":
        from http_overhead import FakePagedModel  # deferred: a sibling script (imports uvicorn)

        return FakePagedModel(49152, args.step_ms / 1000)
    from enginesmith.builder.engine import BuildConfig, cached_engine  # deferred: the CPU engine only
    from enginesmith.runtime.load import open_engine, paged_model  # deferred: the CPU engine only

    engine = cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged"), progress=False)
    return paged_model(open_engine(engine, device="cpu", threads=args.threads), num_pages=4096)


def run(model, args, async_steps: bool) -> dict:
    rng = np.random.default_rng(0)
    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=args.batch, max_tokens=max(256, args.batch * 2),
                                                       chunk=64, async_steps=async_steps),
                                enable_prefix_caching=False)
    ids = [batcher.add_request(rng.integers(300, 40000, args.prompt).tolist(), args.new_tokens,
                               sampling=SamplingParams(seed=i))  # the fake's tokens follow the seed
           for i in range(args.batch)]
    decode_s, tokens, start = [], 0, time.perf_counter()
    while batcher.has_unfinished:
        t0 = time.perf_counter()
        out = batcher.step()
        if out.width == 1 and len(out.scheduled) == args.batch:
            decode_s.append(time.perf_counter() - t0)
        tokens += len(out.new_tokens)
    wall = time.perf_counter() - start
    batcher.close()
    return {"async_steps": async_steps, "decode_steps": len(decode_s),
            "step_ms_median": 1e3 * statistics.median(decode_s), "tok_s": tokens / wall, "wall_s": wall,
            "outputs": [batcher.finished[r].output for r in ids]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("fake", "cpu"), default="fake")
    p.add_argument("--step-ms", type=float, default=2.5, help="the fake model's step (GIL released)")
    p.add_argument("--batch", type=int, default=64, help="requests, all running at once")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--threads", type=int, default=None, help="ORT intra-op threads (--model cpu)")
    p.add_argument("--repeat", type=int, default=2, help="runs per mode, alternating (the best is kept)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args()
    model = make_model(args)
    best: dict[bool, dict] = {}
    for _ in range(args.repeat):
        for mode in (False, True):
            r = run(model, args, mode)
            if mode not in best or r["step_ms_median"] < best[mode]["step_ms_median"]:
                best[mode] = r
    same = best[False].pop("outputs") == best[True].pop("outputs")
    for r in best.values():
        print(f"{'async' if r['async_steps'] else 'sync ':5s}: decode step {r['step_ms_median']:.3f} ms (median of "
              f"{r['decode_steps']} at batch {args.batch}), {r['tok_s']:.0f} tok/s over the run")
    print(f"speed-up per step {best[False]['step_ms_median'] / best[True]['step_ms_median']:.2f}x; "
          f"same tokens: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "runs": list(best.values()), "same_tokens": same},
                                              indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
