"""`enginesmith eval ppl`: perplexity on a text file or the Jane Austen corpus, optionally against
the PyTorch model, or (--kv) over a long stream under several KV-cache policies."""

from __future__ import annotations

import json

from enginesmith.cli.flags import add_kv_flags, add_model_flags, build_config, check_png, load_engine
from enginesmith.core.errors import UserError
from enginesmith.models import corpus


def add_parser(verbs) -> None:
    p = verbs.add_parser("eval", help="accuracy: perplexity on a text file or the Jane Austen corpus")
    p.add_argument("metric", choices=["ppl"])
    add_model_flags(p)
    p.add_argument("--text", metavar="FILE", help="text file (default: Pride and Prejudice)")
    p.add_argument("--novel", default="prideprejudice", help="Austen novel when --text is not given")
    p.add_argument("--tokens", type=int, default=4096, help="evaluate the first N tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument("--protocol", choices=["harness", "windows"], default="harness",
                   help="harness (default): lm-evaluation-harness's rolling windows, a BOS prefix token where "
                        "the tokenizer adds one (else EOS), every token scored; windows: the protocol before "
                        "session 14, non-overlapping windows without a prefix token, each window's first "
                        "token unscored")
    p.add_argument("--compare", choices=["hf"], default=None, help="also evaluate the PyTorch model")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_kv_flags(p, eval_policies=True)
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> int:
    from enginesmith.measure import report  # deferred: imports onnxruntime (optional; --help works without)

    if args.text is not None:  # a missing, unreadable or non-UTF-8 file: one line before the engine loads
        corpus.load_text(args.text)
    if args.kv:
        return _eval_stream(args)
    loaded = load_engine(args)
    result = report.eval_ppl(loaded, args.text, args.novel, args.tokens, args.window,
                             compare_hf=args.compare == "hf", protocol=args.protocol)
    print(json.dumps(result) if args.json else report.format_ppl(result))
    return 0


def _eval_stream(args) -> int:
    """eval ppl --kv ...: the long-stream comparison (measure.streaming), one engine per policy."""
    from enginesmith.measure import streaming  # deferred: imports onnxruntime (optional)

    policies = [p.strip() for p in args.kv.split(",") if p.strip()]
    unknown = [p for p in policies if p not in streaming.POLICIES]
    if unknown or not policies:
        raise UserError(f"unknown --kv policy {', '.join(unknown) or '(none)'}",
                        f"use one or more of: {', '.join(streaming.POLICIES)}")
    if args.engine:
        raise UserError("--kv builds one engine per policy", "leave out --engine (use --model)")
    capacity = args.sinks + args.kv_window
    configs = {"dense": build_config(args, "dense"), "recompute": build_config(args, "dense"),
               "ring": build_config(args, "ring"), "window": build_config(args, "ring", 0, capacity)}
    if not 1 <= args.stride <= capacity:
        raise UserError(f"--stride {args.stride} is outside [1, {capacity}]", "use a stride within the window")
    if args.plot:
        check_png(args.plot, "--plot")
    opened: dict = {}
    runs, ids = [], None
    for policy in policies:
        config = configs[policy]
        if config not in opened:
            opened[config] = load_engine(args, config)
        loaded = opened[config]
        if ids is None:
            ids = corpus.tokenize(loaded.tokenizer, corpus.load_text(args.text, novel=args.novel), args.tokens)
        if policy == "recompute":
            runs.append(streaming.run_recompute(loaded.engine, ids, capacity, args.stride))
        else:
            runs.append(streaming.run_cached(policy, loaded.engine, ids))
    text = args.text or f"austen:{args.novel}"
    summaries = [streaming.summary(r) for r in runs]
    if args.plot:
        streaming.plot(runs, args.plot, title=f"{text}, {len(ids)} tokens, cache {capacity}")
    print(json.dumps({"text": text, "runs": summaries}) if args.json else streaming.format_table(summaries, text))
    return 0

