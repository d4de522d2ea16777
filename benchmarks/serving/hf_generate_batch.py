"""HF transformers `generate` at batch B (padded prompts, static cache): the baseline of issue 18's
"offline throughput >= 3x HF generate at batch 64". Same model spec as our engine (models.load), fp16,
greedy, every row forced to exactly --new-tokens (min_new_tokens), prompts of real Austen text.

    python3 benchmarks/serving/hf_generate_batch.py --model random:llama-3.2-1b --batch 64 \
        --prompt-tokens 512 --new-tokens 256 --json-out $OUT/hf_generate.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from enginesmith.models import corpus
from enginesmith.models import load as models


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:llama-3.2-1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    loaded = models.load(models.resolve(args.model))
    model = loaded.model.to("cuda", dtype=torch.float16).eval()
    ids = corpus.tokenize(loaded.tokenizer, corpus.austen_text(), args.batch * args.prompt_tokens).tolist()
    prompt = torch.tensor(ids, dtype=torch.long).reshape(args.batch, args.prompt_tokens).cuda()
    mask = torch.ones_like(prompt)
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    kwargs = dict(attention_mask=mask, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                  do_sample=False, cache_implementation="static", pad_token_id=pad)
    with torch.inference_mode():
        model.generate(prompt, **(kwargs | {"max_new_tokens": 8, "min_new_tokens": 8}))  # warm-up
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(prompt, **kwargs)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    new = (out.shape[1] - args.prompt_tokens) * args.batch
    best = min(times)
    result = {"what": "hf-generate-static-cache", "model": args.model, "batch": args.batch,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "seconds": best,
              "tok_s": new / best, "device": torch.cuda.get_device_name(), "transformers": __import__("transformers").__version__}
    print(json.dumps(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
