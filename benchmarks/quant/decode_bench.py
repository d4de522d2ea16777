"""CPU decode speed of SmolLM2 engines: fp32 vs the quantized graphs built by ppl_table.py.

    python benchmarks/quant/decode_bench.py [--tokens 64] [--repeats 5] [--threads N]

A plain greedy loop through OrtEngine: prefill a 32-token prompt, then decode `tokens` tokens one
at a time (argmax on the host). Engines take turns in every repeat, so a busy machine slows them
alike; we report the median over repeats of the mean decode ms/token, and the prefill time.
Results go to benchmarks/quant/results/decode.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent


def decode(engine, prompt: np.ndarray, tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, mean decode seconds/token, generated ids)."""
    cache = engine.new_cache(1)
    seq = prompt.shape[1]
    start = time.perf_counter()
    logits = engine.forward(prompt, np.ones((1, seq), np.int64), np.arange(seq)[None], cache)
    prefill = time.perf_counter() - start
    out = [int(logits[0, -1].argmax())]
    start = time.perf_counter()
    for i in range(tokens - 1):
        pos = seq + i
        logits = engine.forward(np.array([[out[-1]]]), np.ones((1, pos + 1), np.int64),
                                np.array([[pos]]), cache)
        out.append(int(logits[0, -1].argmax()))
    return prefill, (time.perf_counter() - start) / (tokens - 1), out


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", nargs="*", default=[
        "fp32", "w4a16-awq-g128", "w4a16-awq-g128-L4", "w4a16-awq-g128+emb8", "w4a16-awq-g128+emb8-L4",
        "w8a8-sq"])
    args = ap.parse_args()

    import onnxruntime

    from enginesmith.models.corpus import austen_text
    from enginesmith.models.corpus import tokenize
    from enginesmith.models.load import load_tokenizer, resolve
    from enginesmith.core.paths import cache_dir
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    sys.path.insert(0, str(HERE))
    from ppl_table import exported, size_of

    paths = {"fp32": exported("fp32")}
    for name in args.configs[1:]:
        path = cache_dir() / "bench" / "quant" / name / "model.onnx"
        if path.is_file():
            paths[name] = path
        else:
            print(f"skipping {name}: {path} not built (run ppl_table.py first)", file=sys.stderr)
    tokenizer = load_tokenizer(resolve(None))
    prompt = tokenize(tokenizer, austen_text("emma"))[:32][None]
    engines = {n: OrtEngine(p, device="cpu", threads=args.threads) for n, p in paths.items()}
    for engine in engines.values():  # warm-up (MatMulNBits packs its weights on the first run)
        decode(engine, prompt, 4)
    runs = {n: [] for n in engines}
    for _ in range(args.repeats):
        for name, engine in engines.items():
            runs[name].append(decode(engine, prompt, args.tokens))
    ref_tokens = runs["fp32"][0][2]
    rows = {}
    for name, r in runs.items():
        ms = float(np.median([x[1] for x in r]) * 1e3)
        rows[name] = {"decode_ms_per_token": ms, "tokens_per_s": 1e3 / ms,
                      "prefill_ms_32": float(np.median([x[0] for x in r]) * 1e3),
                      "greedy_prefix_equal_to_fp32": _common_prefix(r[0][2], ref_tokens),
                      "bytes": size_of(paths[name])}
        print(f"{name:22s} {ms:7.2f} ms/token", file=sys.stderr)
    meta = {"device": f"CPU {platform.processor() or platform.machine()}, "
                      f"{args.threads or 'all'} threads (shared machine)",
            "ort": onnxruntime.__version__, "tokens": args.tokens, "repeats": args.repeats,
            "date": time.strftime("%Y-%m-%d")}
    out = HERE / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"SmolLM2 greedy decode on ORT CPU ({meta['device']}), 32-token prompt, {args.tokens} "
             f"tokens, median of {args.repeats} interleaved runs.", "",
             "| engine | decode ms/token | tokens/s | prefill 32 tok (ms) | greedy tokens equal to fp32's "
             "before the first difference | size (MB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['decode_ms_per_token']:.2f} | {row['tokens_per_s']:.1f} | "
                     f"{row['prefill_ms_32']:.1f} | {row['greedy_prefix_equal_to_fp32']}/{args.tokens} | "
                     f"{row['bytes'] / 1e6:.1f} |")
    (out / "decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
