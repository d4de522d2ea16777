"""What `enginesmith bench` and `enginesmith eval` compute and print, over an opened engine.

The CLI resolves the engine (and, with --compare, the PyTorch model it was built from); these
functions run the measurement and format it. Results are plain JSON-able dicts.
"""

from __future__ import annotations

from enginesmith.core.errors import UserError
from enginesmith.measure import perplexity, speed
from enginesmith.models import corpus
from enginesmith.models import load as models


def source_model(manifest):
    """The fp32 PyTorch model an engine was built from (for --compare hf)."""
    return models.load(manifest.source.path).model


COMPARE = ("hf", "hf-compile")


def hf_model(loaded):
    """The PyTorch model of --compare: the source model on the engine's device, in the engine's
    float type on CUDA (fp16 for fp16 and fp16+w4a16 engines, bf16 for bf16), fp32 on the CPU."""
    import torch

    model = source_model(loaded.manifest)
    if loaded.engine.device == "cuda":
        precision = (loaded.manifest.precision or "fp32")
        dtype = torch.bfloat16 if precision.startswith("bf16") else \
            torch.float16 if precision.startswith("fp16") else torch.float32
        model = model.to("cuda", dtype=dtype)
    return model.eval()


def bench(loaded, prompt_tokens: int, new_tokens: int, batch: int, repeats: int,
          compare: tuple[str, ...] = (), threads: int | None = None) -> dict:
    """Our engine, then (compare) HF transformers eager ("hf") and HF's static cache +
    torch.compile ("hf-compile", CUDA), all on one prompt; plus the bandwidth bound of our engine's
    device (weights + KV at the mean context per step over the measured copy bandwidth)."""
    unknown = [c for c in compare if c not in COMPARE]
    if unknown:
        raise UserError(f"unknown --compare {', '.join(unknown)}", f"use one or more of: {', '.join(COMPARE)}")
    device = loaded.engine.device
    if "hf-compile" in compare and device != "cuda":
        raise UserError("--compare hf-compile (static cache + torch.compile) runs on CUDA only",
                        "run on a GPU machine with --device cuda, or use --compare hf")
    prompt = speed.make_prompt(prompt_tokens, batch, loaded.engine.vocab, loaded.tokenizer)
    if prompt_tokens + new_tokens > loaded.max_positions:
        raise UserError(f"prompt {prompt_tokens} + new {new_tokens} tokens exceed the context of "
                        f"{loaded.max_positions}", "use fewer --prompt-tokens/--new-tokens")
    result = {
        "model": loaded.manifest.source.name, "engine": str(loaded.path),
        "precision": loaded.manifest.precision, "batch": batch,
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
        "enginesmith": speed.bench_engine(loaded.engine, prompt=prompt, new_tokens=new_tokens,
                                          warmup=1, repeats=repeats),
    }
    result["bound"] = engine_bound(loaded, result["enginesmith"]["decode_tok_s"], batch,
                                   prompt_tokens + new_tokens // 2)
    if compare:
        model = hf_model(loaded)
        if "hf" in compare:
            result["hf"] = speed.bench_hf(model, prompt=prompt, new_tokens=new_tokens, warmup=1,
                                          repeats=repeats, threads=threads)
            result["decode_speedup_vs_hf"] = round(
                result["enginesmith"]["decode_tok_s"] / result["hf"]["decode_tok_s"], 2)
            result["prefill_speedup_vs_hf"] = round(
                result["enginesmith"]["prefill_tok_s"] / result["hf"]["prefill_tok_s"], 2)
        if "hf-compile" in compare:
            result["hf_compile"] = speed.bench_hf_generate(model, prompt, new_tokens, repeats, static=True)
            result["decode_speedup_vs_hf_compile"] = round(
                result["enginesmith"]["decode_tok_s"] / result["hf_compile"]["decode_tok_s"], 2)
    return result


def engine_bound(loaded, tok_s: float, batch: int, context: int) -> dict:
    """speed.bandwidth_bound for this engine: its graph's weight bytes, its KV shape and dtype at
    `context` positions, the copy bandwidth of the device it runs on."""
    m = loaded.manifest.model
    device = loaded.engine.device
    bandwidth = speed.measure_copy_bandwidth()
    gbs = bandwidth.get("cuda_gbs") if device == "cuda" else bandwidth["cpu_gbs"]
    kv_bytes = 2 if (loaded.manifest.precision or "fp32").startswith(("fp16", "bf16")) else 4
    out = speed.bandwidth_bound(speed.onnx_weight_bytes(loaded.path / loaded.manifest.graph), gbs,
                                layers=m.layers, kv_heads=m.kv_heads, head_dim=m.head_dim,
                                context=context, batch=batch, kv_bytes=kv_bytes, measured_tok_s=tok_s)
    return out | {"device": device, "context": context}


def format_bench(r: dict) -> str:
    rows = [("enginesmith", r["enginesmith"])] + ([("hf eager", r["hf"])] if "hf" in r else []) + \
        ([("hf compile", r["hf_compile"])] if "hf_compile" in r else [])
    lines = [f"{r['model']} {r['precision']} batch {r['batch']}, prompt {r['prompt_tokens']}, "
             f"{r['new_tokens']} new tokens on {r['enginesmith']['device_name']}",
             f"{'':12} {'prefill tok/s':>14} {'decode ms/tok':>14} {'decode tok/s':>13} {'peak RSS MiB':>13}"]
    for name, x in rows:
        rss = x.get("peak_rss_mib")
        lines.append(f"{name:12} {x['prefill_tok_s']:>14.1f} {x['decode_ms_per_token']:>14.2f} "
                     f"{x['decode_tok_s']:>13.1f} {rss if rss is not None else float('nan'):>13.0f}")
    if "hf" in r:
        lines.append(f"speedup vs HF eager: decode {r['decode_speedup_vs_hf']}x, "
                     f"prefill {r['prefill_speedup_vs_hf']}x")
    if "hf_compile" in r:
        lines.append(f"speedup vs HF static cache + torch.compile: decode {r['decode_speedup_vs_hf_compile']}x")
    b = r.get("bound")
    if b:
        lines.append(f"bandwidth bound: {b['tok_s_bound']:.1f} tok/s ({b['weight_bytes'] / 1e6:.1f} MB weights + "
                     f"{b['kv_bytes_per_step'] / 1e6:.1f} MB KV per step at {b['bandwidth_gbs']:.0f} GB/s copy "
                     f"bandwidth); reached {100 * b['fraction_of_bound']:.1f} %")
    return "\n".join(lines)


def eval_ppl(loaded, text_path: str | None, novel: str, tokens: int, window: int,
             compare_hf: bool = False, protocol: str = "harness") -> dict:
    """`eval ppl`'s result: perplexity.perplexity's keys for the engine (and under "hf" the PyTorch
    model's, same protocol and windows) plus the model, text and, for the harness protocol, the
    prefix token's text and where it came from ("bos" or "eos"; both None for `windows`)."""
    if tokens < window:
        raise UserError(f"--tokens {tokens} is smaller than --window {window}", "use --tokens >= --window")
    if window > loaded.max_positions:
        raise UserError(f"--window {window} exceeds the model's context of {loaded.max_positions}",
                        f"use --window <= {loaded.max_positions}")
    text = corpus.load_text(text_path, novel=novel)
    ids = corpus.tokenize(loaded.tokenizer, text, tokens)
    prefix, source, token = perplexity.prefix_token(loaded.tokenizer) if protocol == "harness" else (None,) * 3

    def measure(fn):
        return perplexity.perplexity(fn, ids, window=window, protocol=protocol, prefix_token=prefix)

    result = {"model": loaded.manifest.source.name, "precision": loaded.manifest.precision,
              "text": text_path or f"austen:{novel}", **measure(perplexity.ort_logits_fn(loaded.engine)),
              "prefix_token": token, "prefix_from": source}
    if compare_hf:
        hf = measure(perplexity.torch_logits_fn(source_model(loaded.manifest)))
        result["hf"] = hf
        result["relative_diff_vs_hf"] = abs(result["ppl"] - hf["ppl"]) / hf["ppl"]
    return result


def format_ppl(r: dict) -> str:
    """One line: perplexity, text, model, then the protocol, windows, stride and prefix token."""
    prefix = ("no prefix token" if r["prefix_token_id"] is None else
              f"prefix token {r['prefix_from'].upper()} {r['prefix_token']!r} (id {r['prefix_token_id']})")
    line = (f"perplexity {r['ppl']:.4f} over {r['tokens']} tokens of {r['text']}, {r['model']} {r['precision']} "
            f"(protocol {r['protocol']}: {r['windows']} windows of {r['window']}, stride {r['stride']}, {prefix})")
    if "hf" in r:
        line += f"\nPyTorch: {r['hf']['ppl']:.4f} (relative difference {r['relative_diff_vs_hf']:.2e})"
    return line
