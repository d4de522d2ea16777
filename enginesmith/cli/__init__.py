"""The `enginesmith` command line: export | build | run | chat | bench | eval.

Every user mistake ends as one line on stderr, `error: <what> (fix: <how>)`, and a non-zero exit
code (2 bad input, 3 bad engine directory, 130 interrupted). Set ENGINESMITH_DEBUG=1 for tracebacks.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
from pathlib import Path

from enginesmith import __version__
from enginesmith.core.engine_dir import Terminated
from enginesmith.core.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, EngineError, UserError

MAX_CUDA_BATCH = 256  # --max-batch of a --for-cuda engine: rows of its KV buffer, each of the full capacity


# ----------------------------------------------------------------------------- shared flags

def _add_model_flags(p: argparse.ArgumentParser, engine: bool = True) -> None:
    g = p.add_argument_group("model (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--model", metavar="PATH", help="HF checkpoint dir, GGUF file, or tiny:<family>")
    if engine:
        g.add_argument("--engine", metavar="DIR", help="an engine directory from `enginesmith build`")
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="ONNX Runtime device")
        g.add_argument("--threads", type=int, default=None, help="intra-op threads (default: all cores)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("generation")
    g.add_argument("--max-tokens", type=int, default=256, help="most new tokens (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats")
    g.add_argument("--seed", type=int, default=None, help="random seed for sampling")
    g.add_argument("--stop", action="append", default=[], metavar="STR", help="stop string (repeatable)")
    g.add_argument("--system", default=None, help="system message for the chat template")
    g.add_argument("--allow-special-tokens-in-text", action="store_true",
                   help="let prompt and --system text that spells a special token (e.g. <|im_start|>) become that "
                        "control token, as when crafting raw prompts (default: such text is encoded as plain text, "
                        "so a prompt cannot open a turn of its own; servers always do this)")


def _add_kv_flags(p: argparse.ArgumentParser, eval_policies: bool = False) -> None:
    g = p.add_argument_group("KV cache (StreamingLLM ring: the first --sinks tokens + the last "
                             "--kv-window tokens, positions in the cache, constant memory)")
    if eval_policies:
        g.add_argument("--kv", metavar="POLICY[,POLICY]", default=None,
                       help="long-stream perplexity under dense | window (no sinks) | ring | recompute "
                            "(sliding window with re-computation), e.g. --kv dense,window,ring,recompute")
        g.add_argument("--stride", type=int, default=1, help="recompute: tokens scored per forward (1 = exact)")
        g.add_argument("--plot", metavar="PNG", default=None, help="write perplexity over position to PNG")
    else:
        g.add_argument("--kv", choices=["dense", "ring", "paged"], default="dense",
                       help="KV layout (default dense; paged = fixed-size pages + block tables)")
        g.add_argument("--page-size", type=int, default=16, help="paged: tokens per KV page (default 16)")
    g.add_argument("--sinks", type=int, default=4, help="attention-sink tokens kept forever (default 4)")
    g.add_argument("--kv-window", type=int, default=1020, help="recent tokens kept (default 1020)")


def _add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (greedy output is unchanged; sampling keeps the model's distribution)")
    g.add_argument("--speculative", metavar="MODE", default=None,
                   help="ngram (prompt lookup: drafts copied from the prompt and output so far) or "
                        "draft:PATH (a small engine dir or model with the same tokenizer proposes tokens)")
    g.add_argument("--k", type=int, default=4, help="most draft tokens per target call (adaptive; default 4)")


def _speculative(args):
    """The SpeculativeConfig for --speculative/--k (validated before any model is loaded), or None."""
    from enginesmith.runtime.speculative import SpeculativeConfig

    if not getattr(args, "speculative", None):
        return None
    if args.speculative != "ngram" and not args.speculative.startswith("draft:"):
        raise UserError(f"unknown --speculative mode {args.speculative!r}", "use --speculative ngram or draft:PATH")
    return SpeculativeConfig(k=args.k)


def _decoder(args, loaded, spec):
    from enginesmith.runtime.speculative import SpeculativeDecoder, open_drafter

    drafter = open_drafter(args.speculative, loaded.engine.vocab, loaded.tokenizer, device=args.device,
                           threads=args.threads)
    return SpeculativeDecoder(drafter, spec)


def _print_speculative(decoder) -> None:
    s = decoder.stats
    print(f"[speculative] {s.new_tokens} tokens in {s.target_calls} target calls "
          f"({s.tokens_per_target_call or 0:.2f} tokens/call), acceptance {s.acceptance_rate or 0:.2f}",
          file=sys.stderr)


def _build_config(args, kv: str | None = None, sinks: int | None = None, window: int | None = None):
    from enginesmith.build.engine import BuildConfig

    kv = kv or getattr(args, "kv", None) or "dense"
    return BuildConfig(model=args.model, kv_layout=kv, kv_sinks=getattr(args, "sinks", 4) if sinks is None else sinks,
                       kv_window=getattr(args, "kv_window", 1020) if window is None else window,
                       page_size=getattr(args, "page_size", 16))


def _open(args, config=None):
    """The LoadedEngine for --engine, --model or the default (built and cached on first use)."""
    from enginesmith.build.engine import cached_engine
    from enginesmith.runtime.load import open_engine

    if args.engine and args.model:
        raise UserError("--engine and --model were both given", "pass only one of them")
    if args.engine and getattr(args, "kv", "dense") not in (None, "dense"):
        raise UserError("--kv was given with --engine, whose KV layout was fixed when it was built",
                        "leave out --engine, or build the engine with `enginesmith build --kv ring`")
    path = Path(args.engine) if args.engine else cached_engine(config or _build_config(args))
    from enginesmith.core import engine_dir
    from enginesmith.build.engine import GQA_IO

    manifest = engine_dir.read_manifest(path)
    if manifest.kv_layout.io == GQA_IO:  # lowered for ORT CUDA
        from enginesmith.runtime.ort_cuda import open_gqa_engine

        return open_gqa_engine(path, device=args.device, max_batch=_gqa_rows(args, manifest))
    return open_engine(path, device=args.device, threads=args.threads)


def _gqa_rows(args, manifest) -> int:
    """KV rows to allocate for a --for-cuda engine: its build's --max-batch (recorded as
    kv_layout.max_batch), else as many as the prompts (or bench's --batch)."""
    rows = max(1, len(getattr(args, "prompt", []) or []), getattr(args, "batch", 1) or 1)
    built = manifest.kv_layout.max_batch  # an integer >= 1 (the schema checks it)
    if built is None:
        return rows
    if built > MAX_CUDA_BATCH:
        raise EngineError(f"build.json kv_layout.max_batch {built} is more than {MAX_CUDA_BATCH}",
                          "rebuild the engine with enginesmith build --for-cuda --max-batch N")
    if rows > built:
        raise UserError(f"{rows} sequences at once exceed the --max-batch {built} this engine was built with",
                        f"rebuild it with --max-batch {rows} or more, or run fewer at once")
    return built


def _sampling(args):
    """Validated before any model is loaded, so a bad value fails in milliseconds (the values'
    rules live in SamplingParams and GenerationConfig; --system and --stop text must be UTF-8)."""
    from enginesmith.runtime.generate import GenerationConfig
    from enginesmith.runtime.sampling import SamplingParams
    from enginesmith.runtime.tokenizer import check_text

    if args.system is not None:
        check_text(args.system, "the --system message")
    for stop in args.stop:
        check_text(stop, "a --stop string")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling)
    return sampling


def _generation_config(args, loaded, sampling):
    from enginesmith.runtime.chat import stop_token_ids
    from enginesmith.runtime.generate import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling,
                            stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest),
                            stop_strings=tuple(args.stop), max_positions=loaded.context_limit)


# ----------------------------------------------------------------------------- verbs

def cmd_export(args) -> int:
    from enginesmith.export.to_onnx import export
    from enginesmith.models import load as models

    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    loaded = models.load(args.model)
    print(f"Exporting {loaded.source.name} ({loaded.family.architecture}) to {out} ...", file=sys.stderr)
    try:
        export(loaded.model, tmp, dtype=args.dtype, opset=args.opset)
        os.replace(tmp.with_name(tmp.name + ".data"), out.with_name(out.name + ".data"))
        os.replace(tmp, out)
    finally:
        for f in (tmp, tmp.with_name(tmp.name + ".data")):
            f.unlink(missing_ok=True)
    print(out)
    return 0


def cmd_build(args) -> int:
    from enginesmith.build.engine import BuildConfig, build

    trt = None
    if args.backend == "trt":
        from enginesmith.build import trt as trt_build

        trt = trt_build.config_from_args(args)
    elif args.preset:
        raise UserError("--preset is a TensorRT (Jetson) preset", "add --backend trt")
    if args.page_size is not None and args.page_size < 1:
        raise UserError(f"--page-size {args.page_size} is not a positive number of tokens", "use e.g. --page-size 16")
    if args.for_cuda:
        return _build_for_cuda(args)
    only_cuda = [flag for flag, given in (("--max-batch", args.max_batch is not None),
                                          ("--quantize-lm-head", args.quantize_lm_head)) if given]
    if only_cuda:
        raise UserError(f"{' and '.join(only_cuda)} belong{'s' * (len(only_cuda) == 1)} to --for-cuda engines",
                        "add --for-cuda" + (" (a TensorRT build takes --trt-max-batch)" if args.max_batch else ""))
    if args.page_size is not None and args.kv != "paged":
        raise UserError(f"--page-size applies to --kv paged, not --kv {args.kv}", "add --kv paged, or drop --page-size")
    path = build(BuildConfig(model=args.model, dtype=args.dtype, opset=args.opset, backend=args.backend,
                             kv_layout=args.kv, kv_sinks=args.sinks, kv_window=args.kv_window,
                             page_size=args.page_size or 16, quant=args.quant, passes=args.passes, block_size=args.block_size, alpha=args.alpha,
                             calib_text=args.calib_text, calib_samples=args.calib_samples,
                             accuracy_level=args.accuracy_level,
                             trt=trt, preset=args.preset, trt_version=args.trt_version),
                 Path(args.out), force=args.force)
    print(path)
    return 0


def _build_for_cuda(args) -> int:
    """build --for-cuda: the plain engine (cached), then build.lower_for_cuda into --out."""
    from enginesmith.build.engine import BuildConfig, cached_engine, lower_for_cuda

    refuse = [(args.backend != "ort", "--backend trt"), (args.kv != "dense", f"--kv {args.kv}"),
              (args.passes is not None, "--passes"), (args.preset is not None, "--preset"),
              (args.quant not in (None, "w4a16-rtn"), f"--quant {args.quant}"),
              (args.dtype == "fp32", "--dtype fp32 (GroupQueryAttention on CUDA is fp16/bf16)")]
    bad = [what for cond, what in refuse if cond]
    if bad:
        raise UserError(f"--for-cuda does not combine with {', '.join(bad)}",
                        "use --for-cuda with --dtype fp16 or bf16 and, for int4 weights, --quant w4a16-rtn")
    if args.page_size is not None:
        raise UserError("--page-size applies to --kv paged; a --for-cuda engine keeps one dense KV buffer",
                        "drop --page-size")
    if args.quantize_lm_head and args.quant != "w4a16-rtn":
        raise UserError("--quantize-lm-head makes the lm_head int4 and needs --quant w4a16-rtn",
                        "add --quant w4a16-rtn, or drop --quantize-lm-head")
    if args.max_batch is not None and not 1 <= args.max_batch <= MAX_CUDA_BATCH:
        raise UserError(f"--max-batch {args.max_batch} is outside 1..{MAX_CUDA_BATCH}",
                        "use the most sequences you will run at once (each holds a full-capacity KV row)")
    from enginesmith.core.onnxruntime_flavour import check as check_onnxruntime

    custom_ops = {"auto": None, "on": True, "off": False}[args.custom_ops]
    if args.custom_attention and custom_ops is False:
        raise UserError("--custom-attention needs the custom ops", "drop --custom-ops off")
    out = Path(args.out)
    if out.exists() and not args.force:
        raise UserError(f"{out} already exists", "pass --force to replace it, or choose another --out")
    # Before minutes of export: ONNX Runtime (the lowering's checks run it) and, when asked for, the ops
    # library (compiled here on first use, or a one-line reason why it cannot be).
    check_onnxruntime()
    if custom_ops or args.custom_attention:
        from enginesmith.plugins import ort_ops

        ort_ops.require()
    src = cached_engine(BuildConfig(model=args.model, dtype=args.dtype, opset=args.opset))
    quant = "w4a16" if args.quant == "w4a16-rtn" else None
    print(lower_for_cuda(src, out, quant=quant, block_size=args.block_size, force=args.force,
                         custom_ops=True if args.custom_attention else custom_ops,
                         custom_attention=args.custom_attention, quantize_lm_head=args.quantize_lm_head,
                         max_batch=args.max_batch))
    return 0


def cmd_run(args) -> int:
    from enginesmith.runtime.chat import encode_prompt
    from enginesmith.runtime.generate import stream
    from enginesmith.runtime.tokenizer import check_text

    sampling = _sampling(args)
    for prompt in args.prompt:  # before the model loads: argv bytes that are not UTF-8 arrive as surrogates
        check_text(prompt, "the prompt")
    spec = _speculative(args)
    loaded = _open(args)
    config = _generation_config(args, loaded, sampling)
    decoder = _decoder(args, loaded, spec) if spec else None
    prompts = [encode_prompt(loaded.tokenizer, p, raw=args.raw, system=args.system,
                             special_tokens_in_text=args.allow_special_tokens_in_text) for p in args.prompt]
    if len(prompts) == 1:  # stream to the terminal as tokens arrive
        if args.raw:
            print(args.prompt[0], end="", flush=True)
        for deltas in stream(loaded.engine, loaded.tokenizer, prompts, config, loaded.pad_id, decoder):
            print(deltas[0], end="", flush=True)
        print()
    else:
        from enginesmith.runtime.generate import generate

        for i, done in enumerate(generate(loaded.engine, loaded.tokenizer, prompts, config, loaded.pad_id, decoder)):
            print(f"[{i}] {args.prompt[i] if args.raw else ''}{done.text}")
    if decoder:
        _print_speculative(decoder)
    return 0


def cmd_chat(args) -> int:
    from enginesmith.runtime.chat import encode_chat
    from enginesmith.runtime.generate import stream

    sampling = _sampling(args)
    loaded = _open(args)
    config = _generation_config(args, loaded, sampling)
    allow = args.allow_special_tokens_in_text
    if loaded.context_limit is None:  # a ring cache: one session, constant memory, no history kept
        return _chat_stream(loaded, config, args.system, special_tokens_in_text=allow)
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []

    def encode() -> list[int]:
        return encode_chat(loaded.tokenizer, history, special_tokens_in_text=allow)

    def reply(line: str):
        history.append({"role": "user", "content": line})
        try:
            ids = encode()
        except UserError:  # e.g. the line is not UTF-8: forget it, keep the session
            history.pop()
            raise
        while len(history) > 1 and len(ids) >= loaded.max_positions:  # drop the oldest turns, not fail
            history.pop(1 if args.system else 0)
            ids = encode()
        text = ""
        try:
            for deltas in stream(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id):
                text += deltas[0]
                yield deltas[0]
        finally:  # also when Ctrl-C stops the reply: keep what was said
            history.append({"role": "assistant", "content": text})

    def reset():
        del history[1 if args.system else 0:]

    return _repl("enginesmith chat: type a message; /reset clears the history, /exit or Ctrl-D quits.",
                 reply, reset)


def _chat_stream(loaded, config, system: str | None, special_tokens_in_text: bool = False) -> int:
    from enginesmith.runtime.ring_chat import ChatSession

    def new_session():
        return ChatSession(loaded.engine, loaded.tokenizer, config, system, loaded.pad_id,
                           special_tokens_in_text=special_tokens_in_text)

    session = [new_session()]
    kv = loaded.kv_layout

    def reset():
        session[0] = new_session()

    return _repl(f"enginesmith chat (ring KV cache: {kv.sinks} sinks + {kv.window} recent tokens, "
                 "constant memory): type a message; /reset starts over, /exit or Ctrl-D quits.",
                 lambda line: session[0].turn(line), reset)


def _repl(banner: str, reply, reset) -> int:
    """The chat loop: read a line, stream reply(line)'s text deltas; /reset, /exit, Ctrl-D, Ctrl-C."""
    print(banner, file=sys.stderr)
    while True:
        try:
            line = input(">>> ").strip()
        except EOFError:
            print()
            return 0
        except UnicodeDecodeError:  # stdin that is not UTF-8: say so, keep the session
            print("error: that line is not UTF-8 text (fix: type or paste UTF-8)", file=sys.stderr)
            continue
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            reset()
            continue
        try:
            for delta in reply(line):
                print(delta, end="", flush=True)
        except KeyboardInterrupt:  # stop this reply, keep the session
            print(" [interrupted]", end="")
        except UserError as exc:  # a bad line (too long, not text): one line, keep the session
            print(f"error: {exc}", file=sys.stderr)
            continue
        print()


def cmd_bench(args) -> int:
    from enginesmith.measure import report

    spec = _speculative(args)
    compare = _compare_list(args.compare)
    loaded = _open(args)
    result = report.bench(loaded, args.prompt_tokens, args.new_tokens, args.batch, args.repeats,
                          compare=compare, threads=args.threads)
    if spec:
        from enginesmith.measure import speed
        from enginesmith.runtime.chat import stop_token_ids

        drafter = _decoder(args, loaded, spec).drafter
        prompt = speed.make_prompt(args.prompt_tokens, 1, loaded.engine.vocab, loaded.tokenizer)[0]
        result["speculative"] = speed.bench_speculative(loaded.engine, drafter, prompt, args.new_tokens, spec.k,
                                                        args.repeats, stop_token_ids(loaded.tokenizer, loaded.manifest))
    print(json.dumps(result) if args.json else report.format_bench(result) + _format_speculative(result))
    return 0


def _compare_list(text: str | None) -> tuple[str, ...]:
    """--compare hf,hf-compile -> ("hf", "hf-compile"), checked before any model is loaded."""
    from enginesmith.measure.report import COMPARE

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


def cmd_eval(args) -> int:
    from enginesmith.measure import report

    if args.kv:
        return _eval_stream(args)
    loaded = _open(args)
    result = report.eval_ppl(loaded, args.text, args.novel, args.tokens, args.window,
                             compare_hf=args.compare == "hf")
    print(json.dumps(result) if args.json else report.format_ppl(result))
    return 0


def _eval_stream(args) -> int:
    """eval ppl --kv ...: the long-stream comparison (measure.streaming), one engine per policy."""
    from enginesmith.measure import perplexity, streaming
    from enginesmith.models import corpus

    policies = [p.strip() for p in args.kv.split(",") if p.strip()]
    unknown = [p for p in policies if p not in streaming.POLICIES]
    if unknown or not policies:
        raise UserError(f"unknown --kv policy {', '.join(unknown) or '(none)'}",
                        f"use one or more of: {', '.join(streaming.POLICIES)}")
    if args.engine:
        raise UserError("--kv builds one engine per policy", "leave out --engine (use --model)")
    capacity = args.sinks + args.kv_window
    configs = {"dense": _build_config(args, "dense"), "recompute": _build_config(args, "dense"),
               "ring": _build_config(args, "ring"), "window": _build_config(args, "ring", 0, capacity)}
    if not 1 <= args.stride <= capacity:
        raise UserError(f"--stride {args.stride} is outside [1, {capacity}]", "use a stride within the window")
    opened: dict = {}
    runs, ids = [], None
    for policy in policies:
        config = configs[policy]
        if config not in opened:
            opened[config] = _open(args, config)
        loaded = opened[config]
        if ids is None:
            ids = perplexity.tokenize(loaded.tokenizer, corpus.load_text(args.text, novel=args.novel), args.tokens)
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


def cmd_doctor(args) -> int:
    from enginesmith.cli import doctor

    found = doctor.checks()
    print(json.dumps(doctor.as_json(found)) if args.json else doctor.format_text(found))
    return 0  # doctor reports; a missing piece is a line with its fix, not a failure


def cmd_plugins_build(args) -> int:
    """plugins build: compile the libraries into the cache ($ENGINESMITH_PLUGINS_BUILD: in place) and
    print their paths, one a line."""
    from enginesmith.plugins import compile as plugin_compile

    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs} must be at least 1", "leave it out to use all cores")
    if args.arch is not None:
        archs = plugin_compile.parse_archs(args.arch)
    else:
        gpu = plugin_compile.detect_gpu()
        if gpu is None:
            raise UserError("no NVIDIA GPU found to compile for",
                            "pass --arch, e.g. --arch 90 (H100/H200) or 80 (A100)")
        archs = (gpu.arch,)
    root = args.tensorrt_root or os.environ.get("TENSORRT_ROOT")
    build_env = os.environ.get(plugin_compile.BUILD_ENV)
    if build_env:
        out = plugin_compile.build_into(Path(build_env), archs, args.trt, root, args.jobs)
    else:
        out = plugin_compile.build_cached(archs, args.trt, root, args.jobs, force=args.force)
    for name, lib in plugin_compile.LIBRARIES.items():
        if not (out / lib).is_file():
            continue
        print(out / lib)
        where = plugin_compile.locate(name, any_arch=True)
        if where is not None and where.built and where.path != out / lib:
            print(f"note: {where.path} ({where.origin}) is found before this {lib}; unset its variable or remove "
                  "it to use this build", file=sys.stderr)
    return 0


# ----------------------------------------------------------------------------- parser

class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line error contract for usage mistakes (exit 2)."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (fix: see `{self.prog} --help`)\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(
        prog="enginesmith",
        description="Turn a Hugging Face causal LM into an inference engine and run it.",
        epilog="Example: enginesmith run \"What is the capital of France?\"")
    top.add_argument("--version", action="version", version=f"enginesmith {__version__}")
    verbs = top.add_subparsers(dest="verb", metavar="VERB", required=True)

    p = verbs.add_parser("export", help="export a model to ONNX with KV-cache inputs/outputs")
    _add_model_flags(p, engine=False)
    p.add_argument("--out", required=True, help="output .onnx path (weights go to <out>.data)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--opset", type=int, default=23)
    p.set_defaults(func=cmd_export)

    p = verbs.add_parser("build", help="build an engine directory (graph, tokenizer, build.json)")
    _add_model_flags(p, engine=False)
    p.add_argument("--out", required=True, help="engine directory to create")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--opset", type=int, default=23)
    p.add_argument("--backend", default="ort", choices=["ort", "trt"],
                   help="ort (ONNX Runtime, default) or trt (TensorRT: needs tensorrt and a GPU)")
    p.add_argument("--force", action="store_true", help="replace an existing engine directory")
    p.add_argument("--for-cuda", action="store_true",
                   help="lower for ONNX Runtime CUDA's decode loop (GroupQueryAttention on one KV buffer, "
                        "CUDA graphs, sampling on the device); fp16/bf16, dense KV, optional --quant w4a16-rtn")
    p.add_argument("--custom-ops", default="auto", choices=["auto", "on", "off"],
                   help="with --for-cuda: run the decode GEMVs as enginesmith's ONNX Runtime ops "
                        "(libenginesmith_ort_ops.so; auto: when it is built)")
    p.add_argument("--custom-attention", action="store_true",
                   help="with --for-cuda: the attention as enginesmith's ORT op too (one kernel per layer: "
                        "faster decode at short contexts; prompts run slower than ORT's flash attention)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="with --for-cuda: sequences run at once (rows of the KV buffer the runtime allocates, "
                        "each of the full capacity; default: as many as the prompts)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --for-cuda --quant w4a16-rtn: the lm_head int4 too (a tied one gets its own matrix)")
    _add_kv_flags(p)
    p.set_defaults(page_size=None)  # given or not: it applies to --kv paged only (default 16 there)
    g = p.add_argument_group("graph passes (see docs: SmoothQuant, W8A8, W4A16 RTN/AWQ, ...)")
    g.add_argument("--quant", default=None, choices=["w8a8-naive", "w8a8-sq", "w4a16-rtn", "w4a16-awq"],
                   help="quantization preset")
    g.add_argument("--passes", default=None, metavar="PIPELINE",
                   help="explicit passes, e.g. smoothquant:alpha=0.6,quantize_w8a8 (after --quant's)")
    g.add_argument("--block-size", type=int, default=128, help="W4A16 block size along K (32/64/128)")
    g.add_argument("--alpha", type=float, default=None,
                   help="SmoothQuant migration strength in [0, 1] for the whole model (default: searched per layer)")
    g.add_argument("--calib-text", metavar="FILE", default=None,
                   help="calibration text (default: Pride and Prejudice)")
    g.add_argument("--calib-samples", type=int, default=32, help="calibration sequences of 512 tokens")
    g.add_argument("--accuracy-level", type=int, default=0, choices=[0, 1, 2, 3, 4],
                   help="ORT MatMulNBits compute: 0 = fp activations (default), 4 = int8 activations "
                        "(SmolLM2 W4A16 on CPU: 1.7x faster decode, perplexity 28.44 -> 28.48)")
    from enginesmith.build import trt as trt_build

    trt_build.add_arguments(p)
    p.set_defaults(func=cmd_build)

    p = verbs.add_parser("trt-lint", help="check a graph against what a TensorRT version can parse")
    from enginesmith.build import trt_lint

    trt_lint.add_arguments(p)
    p.set_defaults(func=trt_lint.run)

    p = verbs.add_parser("triton", help="write a Triton Inference Server model repository for an engine")
    from enginesmith.serving import triton_repository as triton

    triton.add_arguments(p)
    p.set_defaults(func=triton.run)

    p = verbs.add_parser("run", help="generate from one or more prompts (one prompt streams)")
    p.add_argument("prompt", nargs="+", help="prompt text; several prompts run as one batch")
    _add_model_flags(p)
    _add_sampling_flags(p)
    p.add_argument("--raw", action="store_true", help="continue the text as is (no chat template)")
    _add_kv_flags(p)
    _add_speculative_flags(p)
    p.set_defaults(func=cmd_run)

    p = verbs.add_parser("chat", help="interactive chat that streams its answers")
    _add_model_flags(p)
    _add_sampling_flags(p)
    _add_kv_flags(p)
    p.set_defaults(func=cmd_chat)

    p = verbs.add_parser("bench", help="prefill/decode speed and memory (optionally vs HF transformers)")
    _add_model_flags(p)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    p.add_argument("--compare", default=None, metavar="LIST",
                   help="also measure HF transformers: hf (eager), hf-compile (static cache + torch.compile, "
                        "CUDA); comma-separated")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_speculative_flags(p)
    p.set_defaults(func=cmd_bench)

    p = verbs.add_parser("eval", help="accuracy: perplexity on a text file or the Jane Austen corpus")
    p.add_argument("metric", choices=["ppl"])
    _add_model_flags(p)
    p.add_argument("--text", metavar="FILE", help="text file (default: Pride and Prejudice)")
    p.add_argument("--novel", default="prideprejudice", help="Austen novel when --text is not given")
    p.add_argument("--tokens", type=int, default=4096, help="evaluate the first N tokens")
    p.add_argument("--window", type=int, default=1024, help="tokens per window")
    p.add_argument("--compare", choices=["hf"], default=None, help="also evaluate the PyTorch model")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    _add_kv_flags(p, eval_policies=True)
    p.set_defaults(func=cmd_eval)

    p = verbs.add_parser("doctor", help="what this machine has for enginesmith (GPU, ONNX Runtime, CUDA ops, "
                                        "TensorRT, compilers), with the fix for each missing piece")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_doctor)

    p = verbs.add_parser("plugins", help="the CUDA libraries (ONNX Runtime ops, kernels, TensorRT plugins)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = actions.add_parser("build", help="compile them now (else the ops compile on first use) and print their paths")
    q.add_argument("--arch", default=None, metavar="SM",
                   help="CUDA compute capability without the dot, e.g. 90 (H100/H200) or 80,90 "
                        "(default: this machine's GPU)")
    q.add_argument("--trt", action="store_true", help="also the TensorRT plugin library (needs TENSORRT_ROOT)")
    q.add_argument("--tensorrt-root", default=None, metavar="DIR", help="TensorRT install (default: $TENSORRT_ROOT)")
    q.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    q.add_argument("--force", action="store_true", help="compile again even if the cache holds them")
    q.set_defaults(func=cmd_plugins_build)
    return top


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _raise_terminated(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    debug = os.environ.get("ENGINESMITH_DEBUG") == "1"
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_terminated)  # clean up like Ctrl-C (temp dirs, partial outputs)
    try:
        return args.func(args) or 0
    except UserError as exc:
        if debug:
            traceback.print_exc()
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a late second signal must not change the exit status
            signal.signal(sig, signal.SIG_IGN)
        terminated = isinstance(exc, Terminated)
        print(f"\n{'terminated' if terminated else 'interrupted'} (nothing half-written was kept)", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug of ours: one line, and how to see more
        if debug:
            traceback.print_exc()
        if type(exc).__module__.startswith("onnxruntime."):  # the engine's graph failed inside ONNX Runtime
            print(f"error: onnxruntime failed running the engine: {_first_line(exc)} (fix: rebuild the engine "
                  "with `enginesmith build`; if this enginesmith built it, rerun with ENGINESMITH_DEBUG=1 and report "
                  "it)", file=sys.stderr)
            return EngineError.exit_code
        print(f"error: internal error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} "
              "(fix: rerun with ENGINESMITH_DEBUG=1 and report the traceback)", file=sys.stderr)
        return 1
    finally:
        if signal.getsignal(signal.SIGTERM) is _raise_terminated:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run() -> None:
    """The `enginesmith` command: main(), then exit with its status. After an interrupt the process
    leaves at once (os._exit) once its message is out, skipping interpreter shutdown (atexit hooks,
    the worker threads of torch and ONNX Runtime): a full-suite run under load saw such a process,
    its "interrupted" line printed, end by SIGINT (-2) instead of exit status 130."""
    code = main()
    if code in (EXIT_INTERRUPTED, EXIT_TERMINATED):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
                pass
        os._exit(code)
    sys.exit(code)
