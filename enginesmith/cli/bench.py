"""`enginesmith bench`: prefill/decode speed and memory, optionally against HF transformers and with
speculative decoding; with --requests, the offline serving benchmark (many requests through the
continuous batcher of a paged engine, at one or several concurrencies); `bench serve`, load on a
running server over HTTP (cli/bench_serve.py)."""

from __future__ import annotations

import argparse
import json
import sys

from enginesmith.cli import bench_serve, bounds
from enginesmith.cli.flags import (add_model_flags, add_speculative_flags, check_png, int_list, load_engine,
                                   speculative_config, speculative_decoder)
from enginesmith.core.errors import UserError
from enginesmith.runtime.text.chat import stop_token_ids


def add_parser(verbs) -> None:
    p = verbs.add_parser("bench", help="prefill/decode speed and memory (optionally vs HF transformers)")
    add_model_flags(p)
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length (default 128; with --requests: drawn from the prompts' text)")
    p.add_argument("--new-tokens", type=int, default=None,
                   help="tokens generated (default 64; with --requests: drawn from the prompts' text)")
    p.add_argument("--batch", type=int, default=None, help="sequences decoded together (default 1)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs; the median is reported (default 3)")
    p.add_argument("--compare", default=None, metavar="LIST",
                   help="also measure HF transformers: hf (eager), hf-compile (static cache + torch.compile, "
                        "CUDA); comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_speculative_flags(p)
    g = p.add_argument_group("offline serving benchmark (a paged engine: build --kv paged)")
    g.add_argument("--requests", type=int, default=None, metavar="N",
                   help="run N requests through the continuous batcher, at most --concurrency in flight; prompt "
                        "and output lengths are drawn from the Austen corpus unless --prompt-tokens/--new-tokens")
    g.add_argument("--concurrency", default=None, metavar="C[,C...]",
                   help="requests in flight, one run each (default 1,8,64)")
    g.add_argument("--num-pages", type=int, default=None, metavar="K",
                   help="KV pages in the pool (default: what 1 GiB holds for an ONNX Runtime CPU engine; "
                        "--gpu-memory-utilization of the GPU for a --for-cuda engine)")
    g.add_argument("--max-batch-rows", type=int, default=None, metavar="R",
                   help="rows per scheduler step (default: the concurrency, at most a --for-cuda engine's --max-batch)")
    g.add_argument("--chunk", type=int, default=None,
                   help="prefill tokens per row per step (default 128, at most what the engine's attention takes)")
    g.add_argument("--text", default=None, metavar="FILE",
                   help="draw the prompts from this UTF-8 text file's paragraphs (default: the Austen corpus; "
                        "synthetic prompts, with a notice, when it is not installed)")
    g.add_argument("--seed", type=int, default=None, help="workload seed (default 0)")
    g.add_argument("--png", default=None, metavar="FILE", help="write tok/s against concurrency to a PNG")
    p.set_defaults(func=cmd_bench)
    subverbs = p.add_subparsers(dest="bench_verb", metavar="serve", action=_SubVerbs,
                                title="load on a running server (its own flags; see `enginesmith bench serve --help`)")
    bench_serve.add_parser(subverbs)


class _SubVerbs(argparse._SubParsersAction):
    """`bench serve ...` takes only its own flags: a flag of `bench` itself given before `serve`
    (`bench --engine DIR serve`) is refused, not silently dropped or mixed in."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = [a.option_strings[-1] for a in parser._actions
                 if a.option_strings and a.dest != "help" and getattr(namespace, a.dest, a.default) != a.default]
        if given:
            parser.error(f"{given[0]} is a flag of `bench`, given before `{values[0]}`; "
                         f"`bench {values[0]}` takes its own flags after `{values[0]}`")
        super().__call__(parser, namespace, values, option_string)


OFFLINE_ONLY = ("concurrency", "num_pages", "max_batch_rows", "chunk", "seed", "png", "text")
SINGLE_ONLY = ("batch", "repeats", "compare", "speculative")


def cmd_bench(args) -> int:
    offline = args.requests is not None
    given = [name for name in (SINGLE_ONLY if offline else OFFLINE_ONLY) if getattr(args, name) is not None]
    if given:
        flag = "--" + given[0].replace("_", "-")
        if offline:
            raise UserError(f"{flag} belongs to the single-stream bench, not to --requests", f"drop {flag}")
        raise UserError(f"{flag} belongs to the offline benchmark", "add --requests N")
    return cmd_offline(args) if offline else cmd_single(args)


def cmd_single(args) -> int:
    from enginesmith.measure import report, speed  # deferred: imports onnxruntime (optional; --help works without)

    args.prompt_tokens = 128 if args.prompt_tokens is None else args.prompt_tokens
    args.new_tokens = 64 if args.new_tokens is None else args.new_tokens
    args.batch = 1 if args.batch is None else args.batch
    args.repeats = 3 if args.repeats is None else args.repeats
    for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--new-tokens", args.new_tokens),
                        ("--batch", args.batch), ("--repeats", args.repeats)):
        bounds.positive(flag, value)
    spec = speculative_config(args)
    compare = _compare_list(args.compare)
    loaded = load_engine(args, check=bounds.single_stream_check(args.batch, args.prompt_tokens, args.new_tokens,
                                                                args.device))
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


def _paged_config(args):
    """--model (or the default model) with --requests: the paged engine for the device, built once and cached."""
    from enginesmith.builder.engine import BuildConfig  # deferred: imports the exporter (heavy)
    from enginesmith.runtime.engines.ort_engine import resolve_device  # deferred: imports onnxruntime

    cuda = {"target": "ort-cuda", "dtype": "fp16"} if resolve_device(args.device) == "cuda" else {}
    return BuildConfig(model=args.model, kv_layout="paged", **cuda)


def cmd_offline(args) -> int:
    from enginesmith.measure import throughput  # deferred: imports onnxruntime (optional; --help works without)
    from enginesmith.runtime.load import paged_model  # deferred: imports onnxruntime

    concurrencies = int_list(args.concurrency or "1,8,64", "--concurrency")
    for flag, value in (("--requests", args.requests), ("--prompt-tokens", args.prompt_tokens),
                        ("--new-tokens", args.new_tokens), ("--max-batch-rows", args.max_batch_rows),
                        ("--chunk", args.chunk)):
        if value is not None and value < 1:
            raise UserError(f"{flag} {value} is not a positive number", f"give {flag} >= 1")
    if args.num_pages is not None and args.num_pages < 2:
        raise UserError(f"--num-pages {args.num_pages} is too few (page 0 is the null page)", "give --num-pages >= 2")
    if args.png:
        check_png(args.png)
    seed = 0 if args.seed is None else args.seed
    args.batch = args.max_batch_rows  # a CUDA paged engine opens with this many rows (default: its build's)
    loaded = load_engine(args, None if args.engine else _paged_config(args),
                         check=bounds.pool_check(args.num_pages, args.device))
    model = paged_model(loaded, args.num_pages)
    chunk = args.chunk or throughput.CHUNK
    if getattr(model, "max_chunk", None):  # the batcher caps it so too
        chunk = min(chunk, model.max_chunk)
    limit = getattr(model, "max_positions", None) or loaded.max_positions
    max_prompt, max_new = throughput.clips(limit, chunk, args.prompt_tokens, args.new_tokens)
    vocab = getattr(loaded.engine, "vocab", None) or len(loaded.tokenizer)
    source, books, text = throughput.workload_source(loaded.tokenizer, vocab, args.text)
    if text == throughput.SYNTHETIC:
        print(throughput.NO_CORPUS_NOTICE, file=sys.stderr)
    requests = throughput.workload(source, args.requests, seed, args.prompt_tokens, args.new_tokens,
                                   max_prompt=max_prompt, max_new=max_new, books=books)
    need = max(-(-(len(r.prompt) + r.new_tokens) // model.page_size) for r in requests)
    if need > model.num_pages - 1:
        raise UserError(f"the longest request needs {need} KV pages; the pool has {model.num_pages - 1}",
                        f"give --num-pages {need + 1} or more")
    info = throughput.describe_workload(requests, seed, args.prompt_tokens, args.new_tokens, text)
    result = throughput.bench_offline(loaded, model, requests, concurrencies, info, max_batch_rows=args.max_batch_rows,
                                      chunk=chunk, progress=True)
    print(json.dumps(result) if args.json else throughput.format_sweep(result))
    if args.png:
        print(f"wrote {throughput.plot(result, args.png)}", file=sys.stderr)
    leaked = [r for r in result["runs"] if r["leaked_pages"]]
    for r in leaked:
        print(f"error: {r['leaked_pages']} KV pages were not given back at concurrency {r['concurrency']} "
              "(fix: this is a bug of the batcher; please report it)", file=sys.stderr)
    return 1 if leaked else 0
