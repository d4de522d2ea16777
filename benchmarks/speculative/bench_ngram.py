"""Prompt-lookup (n-gram) speculative decoding on an input-grounded workload, SmolLM2, CPU or GPU.

Workload: for each passage of passages.json (Jane Austen), two chat prompts whose answer is
grounded in the input: "repeat this passage word for word" and "correct the spelling of this
passage" (deterministic typos injected). Greedy, up to --max-tokens new tokens, EOS stops.

Plain and speculative decoding run on the same engine, prompt by prompt, interleaved, after one
untimed warm-up each; the speculative output must be token-identical to the plain one.

    CPU:  python benchmarks/speculative/bench_ngram.py --device cpu --out benchmarks/speculative/results/cpu.json
          (engine: the default SmolLM2 fp32 engine, OrtEngine, plain decoding = generate.generate_ids)
    GPU:  python benchmarks/speculative/bench_ngram.py --device cuda --engine DIR_LOWERED_FOR_CUDA --out ...
          (engine: GqaEngine with CUDA graphs, plain decoding = ort_cuda.fast_generate_ids)
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def typos(text: str, rate: float = 0.08, seed: int = 0) -> str:
    """Swap two inner letters in about `rate` of the words (deterministic)."""
    rng = random.Random(seed)
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 4 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def prompts(tokenizer, limit: int | None = None) -> list[tuple[str, list[int]]]:
    from enginesmith.runtime.text.chat import encode_prompt

    passages = json.loads((HERE / "passages.json").read_text())["passages"][:limit]
    out = []
    for i, p in enumerate(passages):
        out.append((f"quote/{p['novel']}#{i}", encode_prompt(
            tokenizer, "Repeat the following passage exactly, word for word:\n\n" + p["text"])))
        out.append((f"correct/{p['novel']}#{i}", encode_prompt(
            tokenizer, "Correct the spelling mistakes in this passage and write it out in full:\n\n"
            + typos(p["text"], seed=i))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--engine", help="engine dir (cuda: an ort-cuda build)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per target call (adaptive)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--passages", type=int, default=None, help="use only the first N passages")
    ap.add_argument("--out", help="write the JSON result here")
    args = ap.parse_args(argv)

    from enginesmith.runtime.decoding import speculative as sp
    from enginesmith.runtime.text.chat import stop_token_ids
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids

    if args.device == "cuda":
        from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

        loaded = open_gqa_engine(args.engine, device="cuda", capacity=2048)
        plain_ids = fast_generate_ids
    else:
        from enginesmith.builder.engine import BuildConfig, cached_engine
        from enginesmith.runtime.load import open_engine

        loaded = open_engine(args.engine or cached_engine(BuildConfig()), device="cpu", threads=args.threads)
        plain_ids = generate_ids
    engine = loaded.engine
    config = GenerationConfig(max_new_tokens=args.max_tokens, stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest),
                              max_positions=loaded.max_positions)
    spec_config = sp.SpeculativeConfig(k=args.k)

    def plain(ids):
        t = time.perf_counter()
        out = [int(step[0]) for step, _ in plain_ids(engine, [ids], config)]
        return out, time.perf_counter() - t

    def speculative(ids, stats):
        t = time.perf_counter()
        out = list(sp.speculative_tokens(engine, sp.NgramDrafter(), ids, config, spec_config, stats))
        return out, time.perf_counter() - t

    work = prompts(loaded.tokenizer, args.passages)
    plain(work[0][1])  # warm-up (session, CUDA graph capture)
    speculative(work[0][1], sp.SpeculativeStats())
    rows, total = [], sp.SpeculativeStats()
    for name, ids in work:
        stats = sp.SpeculativeStats()
        ref, t_plain = plain(ids)
        out, t_spec = speculative(ids, stats)
        for key in ("new_tokens", "target_calls", "draft_calls", "proposed", "accepted"):
            setattr(total, key, getattr(total, key) + getattr(stats, key))
        rows.append({"prompt": name, "prompt_tokens": len(ids), "new_tokens": len(ref), "identical": out == ref,
                     "plain_s": t_plain, "speculative_s": t_spec, "speedup": t_plain / t_spec, **stats.to_json()})
        print(f"{name:28} {len(ref):4d} tok  plain {len(ref) / t_plain:7.1f} tok/s  spec {len(out) / t_spec:7.1f} "
              f"tok/s  x{t_plain / t_spec:.2f}  accept {stats.acceptance_rate or 0:.2f}  "
              f"tok/call {stats.tokens_per_target_call:.2f}  identical {out == ref}", flush=True)
    plain_s = sum(r["plain_s"] for r in rows)
    spec_s = sum(r["speculative_s"] for r in rows)
    tokens = sum(r["new_tokens"] for r in rows)
    result = {
        "benchmark": "prompt-lookup speculative decoding, input-grounded (quote / correct a passage)",
        "model": loaded.manifest.source.name, "precision": loaded.manifest.precision,
        "engine": type(engine).__name__, "device": args.device, "device_name": _device_name(args.device),
        "threads": args.threads, "k": args.k, "max_tokens": args.max_tokens, "prompts": len(rows),
        "all_identical": all(r["identical"] for r in rows), "tokens": tokens,
        "plain_tok_s": tokens / plain_s, "speculative_tok_s": tokens / spec_s, "speedup": plain_s / spec_s,
        "acceptance_rate": total.acceptance_rate, "tokens_per_target_call": total.tokens_per_target_call,
        "python": platform.python_version(), "rows": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if result["all_identical"] else 1


def _device_name(device: str) -> str:
    from enginesmith.measure.speed import device_name

    return device_name(device)


if __name__ == "__main__":
    sys.exit(main())
