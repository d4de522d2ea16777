"""What `enginesmith bench` and `enginesmith eval` compute and print, over an opened engine.

The CLI resolves the engine (and, with --compare hf, the PyTorch model it was built from); these
functions run the measurement and format it. Results are plain JSON-able dicts.
"""

from __future__ import annotations

from enginesmith.measure import speed


def source_model(manifest: dict):
    """The fp32 PyTorch model an engine was built from (for --compare hf)."""
    from enginesmith.models import load as models

    return models.load(manifest["source"]["path"]).model


def bench(loaded, prompt_tokens: int, new_tokens: int, batch: int, repeats: int,
          compare_hf: bool = False, threads: int | None = None) -> dict:
    prompt = speed.make_prompt(prompt_tokens, batch, loaded.engine.vocab, loaded.tokenizer)
    if prompt_tokens + new_tokens > loaded.max_positions:
        from enginesmith.errors import UserError

        raise UserError(f"prompt {prompt_tokens} + new {new_tokens} tokens exceed the context of "
                        f"{loaded.max_positions}", "use fewer --prompt-tokens/--new-tokens")
    result = {
        "model": loaded.manifest["source"]["name"], "engine": str(loaded.path),
        "precision": loaded.manifest.get("precision"), "batch": batch,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "enginesmith": speed.bench_engine(loaded.engine, prompt=prompt, new_tokens=new_tokens,
                                          warmup=1, repeats=repeats),
    }
    if compare_hf:
        model = source_model(loaded.manifest)
        result["hf"] = speed.bench_hf(model, prompt=prompt, new_tokens=new_tokens, warmup=1,
                                      repeats=repeats, threads=threads)
        result["decode_speedup_vs_hf"] = round(
            result["enginesmith"]["decode_tok_s"] / result["hf"]["decode_tok_s"], 2)
        result["prefill_speedup_vs_hf"] = round(
            result["enginesmith"]["prefill_tok_s"] / result["hf"]["prefill_tok_s"], 2)
    return result


def format_bench(r: dict) -> str:
    rows = [("enginesmith", r["enginesmith"])] + ([("hf eager", r["hf"])] if "hf" in r else [])
    lines = [f"{r['model']} {r['precision']} batch {r['batch']}, prompt {r['prompt_tokens']}, "
             f"{r['new_tokens']} new tokens on {r['enginesmith']['device_name']}",
             f"{'':12} {'prefill tok/s':>14} {'decode ms/tok':>14} {'decode tok/s':>13} {'peak RSS MiB':>13}"]
    for name, x in rows:
        lines.append(f"{name:12} {x['prefill_tok_s']:>14.1f} {x['decode_ms_per_token']:>14.2f} "
                     f"{x['decode_tok_s']:>13.1f} {x['peak_rss_mib']:>13.0f}")
    if "hf" in r:
        lines.append(f"speedup vs HF eager: decode {r['decode_speedup_vs_hf']}x, "
                     f"prefill {r['prefill_speedup_vs_hf']}x")
    return "\n".join(lines)


def eval_ppl(loaded, text_path: str | None, novel: str, tokens: int, window: int,
             compare_hf: bool = False) -> dict:
    from enginesmith.errors import UserError
    from enginesmith.measure import corpus, perplexity

    if tokens < window:
        raise UserError(f"--tokens {tokens} is smaller than --window {window}", "use --tokens >= --window")
    if window > loaded.max_positions:
        raise UserError(f"--window {window} exceeds the model's context of {loaded.max_positions}",
                        f"use --window <= {loaded.max_positions}")
    text = corpus.load_text(text_path, novel=novel)
    ids = perplexity.tokenize(loaded.tokenizer, text, tokens)
    result = {"model": loaded.manifest["source"]["name"], "precision": loaded.manifest.get("precision"),
              "text": text_path or f"austen:{novel}",
              **perplexity.perplexity(perplexity.ort_logits_fn(loaded.engine), ids, window=window)}
    if compare_hf:
        hf = perplexity.perplexity(perplexity.torch_logits_fn(source_model(loaded.manifest)), ids, window=window)
        result["hf"] = hf
        result["relative_diff_vs_hf"] = abs(result["ppl"] - hf["ppl"]) / hf["ppl"]
    return result


def format_ppl(r: dict) -> str:
    line = (f"perplexity {r['ppl']:.4f} over {r['tokens']} tokens ({r['windows']} windows of "
            f"{r['window']}) of {r['text']}, {r['model']} {r['precision']}")
    if "hf" in r:
        line += f"\nPyTorch: {r['hf']['ppl']:.4f} (relative difference {r['relative_diff_vs_hf']:.2e})"
    return line
