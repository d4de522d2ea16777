"""Issue 30's accuracy checks of a CUDA engine directory (dense KV, built with --for-cuda):

1. Perplexity: `enginesmith eval ppl` of the engine on the GPU, and of the same model's CPU engine (what
   `eval ppl --device cpu` builds: the default model, or --cpu-model), the same text, tokens and protocol.
   Passes when the two differ by at most --ppl-tolerance (0.5 %). (The CUDA engine itself on the CPU runs
   the ops library's CPU kernels, reference loops: minutes a window; session 18's run was cut there.)
2. Greedy tokens: 24 prompts cut from a novel (lengths from 20 to ~1,500 tokens, so that both prompt kernels
   see work), --new-tokens greedy tokens each, with the default kernels and with the older prompt kernel
   (`ES_GQA_PREFILL=0`: the tensor-core prompt path off). Each side runs in its own process (the ops read
   the variable per call; a process each keeps the sessions apart). Passes when every prompt gives the
   same tokens.

    python3 benchmarks/gpu/accuracy.py --engine /tmp/verify/engines/smollm2_fp16 --out $OUT/accuracy.json

Exit status 0 when both pass, 1 when one does not (the JSON says which and by how much).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT_LENGTHS = [20, 40, 64, 65, 90, 127, 128, 129, 200, 255, 256, 257,
                  300, 384, 480, 511, 512, 600, 700, 767, 800, 900, 1024, 1500]  # 24 prompts


def prompts(tokenizer, capacity: int, new_tokens: int) -> list[list[int]]:
    """The 24 prompts: consecutive stretches of Pride and Prejudice, each cut to its length (within the
    engine's capacity less the new tokens)."""
    from enginesmith.models.corpus import austen_text, tokenize

    ids = tokenize(tokenizer, austen_text()[:400_000]).tolist()
    out, at = [], 0
    for n in PROMPT_LENGTHS:
        n = min(n, capacity - new_tokens)
        out.append(ids[at:at + n])
        at += n
    return out


def greedy_child(engine_dir: str, new_tokens: int, out: Path) -> int:
    """One side of check 2, in this process: every prompt's greedy tokens as JSON."""
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    loaded = open_gqa_engine(engine_dir, device="cuda", max_batch=1)
    rows = []
    for p in prompts(loaded.tokenizer, loaded.engine.capacity, new_tokens):
        steps = fast_generate_ids(loaded.engine, [p], GenerationConfig(max_new_tokens=new_tokens))
        rows.append([int(ids[0]) for ids, _ in steps])
    out.write_text(json.dumps(rows))
    return 0


def _run(cmd: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)


def check_ppl(engine: str, tokens: int, window: int, tolerance: float, cpu_model: str | None) -> dict:
    result = {}
    for device in ("cuda", "cpu"):
        source = ["--engine", engine] if device == "cuda" else (["--model", cpu_model] if cpu_model else [])
        proc = _run([sys.executable, "-P", "-m", "enginesmith.cli", "eval", "ppl", *source,
                     "--device", device, "--tokens", str(tokens), "--window", str(window), "--json"])
        if proc.returncode != 0:
            return {"ok": False, "error": f"eval ppl --device {device}: {proc.stderr.strip()[-600:]}"}
        result[device] = json.loads(proc.stdout.strip().splitlines()[-1])
    rel = abs(result["cuda"]["ppl"] - result["cpu"]["ppl"]) / result["cpu"]["ppl"]
    return {"ok": rel <= tolerance, "ppl_cuda": result["cuda"]["ppl"], "ppl_cpu": result["cpu"]["ppl"],
            "relative_difference": rel, "tolerance": tolerance, "tokens": tokens, "window": window,
            "protocol": result["cuda"].get("protocol"), "text": result["cuda"].get("text"),
            "prefix_token_ids": [result[d].get("prefix_token_id") for d in ("cuda", "cpu")],
            "precisions": [result[d].get("precision") for d in ("cuda", "cpu")]}


def check_greedy(engine: str, new_tokens: int, work: Path) -> dict:
    sides = {}
    for name, value in (("default", None), ("older_prompt_kernel", "0")):
        env = dict(os.environ)
        env.pop("ES_GQA_PREFILL", None)
        if value is not None:
            env["ES_GQA_PREFILL"] = value
        path = work / f"greedy_{name}.json"
        proc = _run([sys.executable, "-P", __file__, "--engine", engine, "--new-tokens", str(new_tokens),
                     "--out", str(path), "--child"], env=env)
        if proc.returncode != 0:
            return {"ok": False, "error": f"greedy ({name}): {proc.stderr.strip()[-600:]}"}
        sides[name] = json.loads(path.read_text())
    a, b = sides["default"], sides["older_prompt_kernel"]
    same = [x == y for x, y in zip(a, b)]
    first_diff = [next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None) for x, y in zip(a, b)]
    return {"ok": all(same) and len(a) == len(b) == len(PROMPT_LENGTHS), "identical": sum(same),
            "prompts": len(a), "new_tokens": new_tokens, "prompt_lengths": PROMPT_LENGTHS,
            "first_differing_token": first_diff}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=8192, help="perplexity: the novel's first N tokens")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--ppl-tolerance", type=float, default=0.005)
    ap.add_argument("--cpu-model", default=None, help="the CPU engine's model (default: enginesmith's default model)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return greedy_child(args.engine, args.new_tokens, args.out)
    import torch

    # the GPU-only check first, and the JSON rewritten after each check: a run cut at its limit keeps what
    # finished (session 18: the CPU engine's perplexity is the slow part)
    result = {"gpu": torch.cuda.get_device_name(0), "engine": args.engine}
    for name, check in (("greedy", lambda: check_greedy(args.engine, args.new_tokens, args.out.parent)),
                        ("ppl", lambda: check_ppl(args.engine, args.tokens, args.window, args.ppl_tolerance,
                                                   args.cpu_model))):
        t0 = time.time()
        result[name] = check() | {"seconds": round(time.time() - t0, 1)}
        args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if result["ppl"]["ok"] and result["greedy"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
