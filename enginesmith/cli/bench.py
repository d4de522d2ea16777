"""`enginesmith bench`: prefill/decode speed and memory, optionally against HF transformers and with
speculative decoding."""

from __future__ import annotations

import json

from enginesmith.cli.flags import (add_model_flags, add_speculative_flags, load_engine, speculative_config,
                                   speculative_decoder)
from enginesmith.core.errors import UserError
from enginesmith.runtime.chat import stop_token_ids


def add_parser(verbs) -> None:
    p = verbs.add_parser("bench", help="prefill/decode speed and memory (optionally vs HF transformers)")
    add_model_flags(p)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--compare", default=None, metavar="LIST",
                   help="also measure HF transformers: hf (eager), hf-compile (static cache + torch.compile, "
                        "CUDA); comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_speculative_flags(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    from enginesmith.measure import report, speed  # deferred: imports onnxruntime (optional; --help works without)

    spec = speculative_config(args)
    compare = _compare_list(args.compare)
    loaded = load_engine(args)
    result = report.bench(loaded, args.prompt_tokens, args.new_tokens, args.batch, args.repeats,
                          compare=compare, threads=args.threads)
    if spec:
        drafter = speculative_decoder(args, loaded, spec).drafter
        prompt = speed.make_prompt(args.prompt_tokens, 1, loaded.engine.vocab, loaded.tokenizer)[0]
        result["speculative"] = speed.bench_speculative(loaded.engine, drafter, prompt, args.new_tokens, spec.k,
                                                        args.repeats, stop_token_ids(loaded.tokenizer, loaded.manifest))
    print(json.dumps(result) if args.json else report.format_bench(result) + _format_speculative(result))
    return 0


def _compare_list(text: str | None) -> tuple[str, ...]:
    """--compare hf,hf-compile -> ("hf", "hf-compile"), checked before any model is loaded."""
    from enginesmith.measure.report import COMPARE  # deferred: imports onnxruntime (optional)

    items = tuple(dict.fromkeys(x.strip() for x in (text or "").split(",") if x.strip()))
    unknown = [x for x in items if x not in COMPARE]
    if unknown:
        raise UserError(f"unknown --compare {', '.join(unknown)}", f"use one or more of: {', '.join(COMPARE)}")
    return items


def _format_speculative(result: dict) -> str:
    s = result.get("speculative")
    if not s:
        return ""
    return (f"\nspeculative ({s['drafter']}, k={s['k']}): {s['speculative_tok_s']:.1f} tok/s vs plain "
            f"{s['plain_tok_s']:.1f} (x{s['speedup']:.2f}), acceptance {s['acceptance_rate'] or 0:.2f}, "
            f"{s['tokens_per_target_call'] or 0:.2f} tokens/target call, identical output: {s['identical']}")
