"""H2O (heavy-hitter eviction) against the StreamingLLM ring and the dense cache, at one KV budget.

    python benchmarks/streaming/h2o_stream.py --tokens 4096 --budget-fraction 0.2       # shorter than the context
    python benchmarks/streaming/h2o_stream.py --tokens 20480 --budget-fraction 0.2      # the 20k-token stream
    python benchmarks/streaming/h2o_stream.py --tokens 20480 --budget 1024 --policies h2o,ring

Text: continuous *Pride and Prejudice* (no BOS), scored token after token as in long_stream.py
(measure.streaming.run_cached: the first `budget` tokens as a prefill, then one token per step).
Budget B = fraction x tokens (or --budget): h2o keeps B slots (B/2 recent + B/2 heavy hitters,
one eviction per step shared by all layers and heads), ring keeps 4 sinks + B - 4 recent, dense
keeps everything (memory and positions grow; beyond the 8192-token context it degrades). Results:
results/h2o_<tokens>.json (+ .md); per-token nll of each policy in results/h2o_<tokens>_<policy>.npz.
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

from enginesmith.measure import streaming  # noqa: E402
from enginesmith.models import corpus  # noqa: E402

HERE = Path(__file__).resolve().parent


def engine_for(model, device: str, policy: str, budget: int):
    from enginesmith.builder.engine import BuildConfig, cached_engine
    from enginesmith.runtime.load import open_engine

    if policy == "dense":
        config = BuildConfig(model=model)
    elif policy == "ring":
        config = BuildConfig(model=model, kv_layout="ring", kv_sinks=4, kv_window=budget - 4)
    else:
        config = BuildConfig(model=model, kv_layout="h2o", kv_budget=budget)
    return open_engine(cached_engine(config, progress=False), device=device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--budget-fraction", type=float, default=0.2)
    p.add_argument("--budget", type=int, default=None, help="KV slots (default: fraction x tokens)")
    p.add_argument("--novel", default="prideprejudice")
    p.add_argument("--policies", default="dense,ring,h2o")
    p.add_argument("--out", type=Path, default=HERE / "results")
    args = p.parse_args()
    budget = args.budget or int(round(args.budget_fraction * args.tokens))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"h2o_{args.tokens}"
    summary_path = args.out / f"{stem}.json"
    saved = json.loads(summary_path.read_text()) if summary_path.is_file() else {"runs": {}}
    for policy in args.policies.split(","):
        loaded = engine_for(args.model, args.device, policy, budget)
        ids = corpus.tokenize(loaded.tokenizer, corpus.load_text(None, novel=args.novel), args.tokens)
        started = time.time()
        result = streaming.run_cached(policy if policy == "dense" else "ring", loaded.engine, ids, progress=False)
        result.policy = policy
        summary = streaming.summary(result)
        summary.update(budget=budget if policy != "dense" else None, wall_seconds=round(time.time() - started, 1))
        np.savez(args.out / f"{stem}_{policy}.npz", nll=result.nll)
        saved["runs"][policy] = summary
        saved["meta"] = {"tokens": int(len(ids)), "text": f"austen:{args.novel}", "budget": budget,
                         "budget_fraction": budget / len(ids), "device": common.device_name(args.device),
                         "model": args.model or "SmolLM2-135M-Instruct (fp32)", "date": time.strftime("%Y-%m-%d")}
        runs = saved["runs"]
        if "dense" in runs:
            saved["ratio_to_dense"] = {k: r["ppl"] / runs["dense"]["ppl"] for k, r in runs.items()}
        summary_path.write_text(json.dumps(saved, indent=1))
        _markdown(args.out / f"{stem}.md", saved)
        print(f"{policy}: ppl {summary['ppl']:.3f}, {summary['ms_per_step']:.2f} ms/step, cache "
              f"{summary['cache_mib_first']}..{summary['cache_mib_last']} MiB, {time.time() - started:.0f} s",
              flush=True)


def _markdown(path: Path, saved: dict) -> None:
    meta = saved["meta"]
    lines = [f"{meta['model']}, {meta['text']}, {meta['tokens']} tokens scored one by one after the first "
             f"budget; KV budget {meta['budget']} slots ({100 * meta['budget_fraction']:.0f} %); {meta['device']}.",
             "", "| policy | KV slots | perplexity | × dense | cache MiB (first → last) | ms/token |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in saved["runs"].items():
        ratio = saved.get("ratio_to_dense", {}).get(name)
        slots = "all" if name == "dense" else str(r["budget"])
        lines.append(f"| {name} | {slots} | {r['ppl']:.3f} | {'' if ratio is None else f'{ratio:.3f}'} | "
                     f"{r['cache_mib_first']} → {r['cache_mib_last']} | {r['ms_per_step']} |")
    lines += ["", "ring = 4 sinks + (budget - 4) recent (StreamingLLM); h2o = budget / 2 recent + the heaviest "
              "hitters by accumulated attention (one eviction per step for all layers and heads)."]
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
