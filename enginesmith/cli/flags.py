"""The flag groups that several verbs share (model, generation, KV cache, speculative decoding) and
the helpers that turn those flags into what the runtime takes: a BuildConfig, the opened engine,
SamplingParams, a GenerationConfig, a speculative decoder.

Values are validated here, before any model is loaded, so a bad flag fails in milliseconds. The
modules that import onnxruntime (runtime.load, runtime.engines.ort_cuda, runtime.decoding.speculative) are imported
where they are used: without ONNX Runtime, --help and doctor still work and a verb fails in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from enginesmith.builder.engine import BuildConfig, cached_engine
from enginesmith.cli import bounds
from enginesmith.core import engine_dir, kv_spec
from enginesmith.core.errors import UserError
from enginesmith.core.out_paths import check_out
from enginesmith.runtime.text.chat import stop_token_ids
from enginesmith.runtime.decoding.generate import GenerationConfig
from enginesmith.runtime.decoding.sampling import SamplingParams
from enginesmith.runtime.text.tokenizer import check_text

if TYPE_CHECKING:
    from enginesmith.runtime.decoding.speculative import SpeculativeConfig, SpeculativeDecoder



# ----------------------------------------------------------------------------- flag groups

def add_model_flags(p: argparse.ArgumentParser, engine: bool = True) -> None:
    g = p.add_argument_group("model (default: the embedded SmolLM2-135M-Instruct)")
    g.add_argument("--model", metavar="PATH", type=bounds.nonempty, help="HF checkpoint dir, GGUF file, or tiny:<family>")
    if engine:
        g.add_argument("--engine", metavar="DIR", type=bounds.nonempty, help="an engine directory from `enginesmith build`")
        g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="ONNX Runtime device")
        g.add_argument("--threads", type=bounds.threads, default=None,
                       help="intra-op threads, at most twice the cores (default: all cores)")
        g.add_argument("--gpu-memory-utilization", type=bounds.fraction, default=0.9, metavar="FRACTION",
                       help="a --for-cuda --kv paged engine sizes its KV page pool to this share of the GPU's "
                            "memory, weights and activations included (default 0.9)")


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
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


def add_kv_flags(p: argparse.ArgumentParser, eval_policies: bool = False) -> None:
    g = p.add_argument_group("KV cache (StreamingLLM ring: the first --sinks tokens + the last "
                             "--kv-window tokens, positions in the cache, constant memory)")
    if eval_policies:
        g.add_argument("--kv", metavar="POLICY[,POLICY]", default=None,
                       help="long-stream perplexity under dense | window (no sinks) | ring | recompute "
                            "(sliding window with re-computation), e.g. --kv dense,window,ring,recompute")
        g.add_argument("--stride", type=int, default=1, help="recompute: tokens scored per forward (1 = exact)")
        g.add_argument("--plot", metavar="PNG", default=None, help="write perplexity over position to PNG")
    else:
        g.add_argument("--kv", choices=kv_spec.BUILD_CHOICES, default="dense",
                       help="KV layout (default dense; paged = fixed-size pages + block tables; h2o = "
                            "--kv-budget slots, evicting the least-attended token (heavy hitters + recent))")
        g.add_argument("--kv-budget", type=int, default=1024, help="h2o: KV slots kept (default 1024)")
        g.add_argument("--page-size", type=int, default=16, help="paged: tokens per KV page (default 16)")
    g.add_argument("--sinks", type=int, default=4, help="attention-sink tokens kept forever (default 4)")
    g.add_argument("--kv-window", type=int, default=1020, help="recent tokens kept (default 1020)")


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (greedy output is unchanged; sampling keeps the model's distribution)")
    g.add_argument("--speculative", metavar="MODE", default=None,
                   help="ngram (prompt lookup: drafts copied from the prompt and output so far) or "
                        "draft:PATH (a small engine dir or model with the same tokenizer proposes tokens)")
    g.add_argument("--k", type=int, default=4, help="most draft tokens per target call (adaptive; default 4)")


# ----------------------------------------------------------------------------- flags -> runtime

def speculative_config(args) -> SpeculativeConfig | None:
    """The SpeculativeConfig for --speculative/--k (validated before any model is loaded), or None."""
    from enginesmith.runtime.decoding.speculative import SpeculativeConfig  # deferred: imports onnxruntime (optional)

    if not getattr(args, "speculative", None):
        return None
    if args.speculative != "ngram" and not args.speculative.startswith("draft:"):
        raise UserError(f"unknown --speculative mode {args.speculative!r}", "use --speculative ngram or draft:PATH")
    return SpeculativeConfig(k=args.k)


def speculative_decoder(args, loaded, spec: SpeculativeConfig) -> SpeculativeDecoder:
    from enginesmith.runtime.decoding.speculative import SpeculativeDecoder, draft_model  # deferred: onnxruntime
    from enginesmith.runtime.load import open_drafter  # deferred: with the line above

    where = draft_model(args.speculative)  # None for ngram
    if where is None:
        source: object = "ngram"
    elif os.path.isfile(Path(where) / engine_dir.MANIFEST):
        source = Path(where)
    else:  # a model spec: built and cached like --model
        source = cached_engine(BuildConfig(model=where))
    drafter = open_drafter(source, loaded.engine.vocab, loaded.tokenizer, device=args.device, threads=args.threads)
    return SpeculativeDecoder(drafter, spec)


def print_speculative(decoder: SpeculativeDecoder) -> None:
    s = decoder.stats
    print(f"[speculative] {s.new_tokens} tokens in {s.target_calls} target calls "
          f"({s.tokens_per_target_call or 0:.2f} tokens/call), acceptance {s.acceptance_rate or 0:.2f}",
          file=sys.stderr)


def build_config(args, kv: str | None = None, sinks: int | None = None, window: int | None = None) -> BuildConfig:
    """The BuildConfig of the engine that --model (and the KV flags, or the overrides) ask for."""
    kv = kv or getattr(args, "kv", None) or "dense"
    return BuildConfig(model=args.model, kv_layout=kv, kv_sinks=getattr(args, "sinks", 4) if sinks is None else sinks,
                       kv_window=getattr(args, "kv_window", 1020) if window is None else window,
                       page_size=getattr(args, "page_size", 16), kv_budget=getattr(args, "kv_budget", 1024))


def load_engine(args, config: BuildConfig | None = None, check=None):
    """The LoadedEngine for --engine, --model or the default (built and cached on first use), through
    the runtime's one front door; a CUDA-lowered engine gets KV rows for every prompt (or bench's --batch).
    `check(manifest)` runs before the engine opens (memory bounds: nothing is allocated yet)."""
    from enginesmith.runtime.load import open_engine  # deferred: imports onnxruntime (optional)

    if args.engine and args.model:
        raise UserError("--engine and --model were both given", "pass only one of them")
    if args.engine and getattr(args, "kv", "dense") not in (None, "dense"):
        raise UserError("--kv was given with --engine, whose KV layout was fixed when it was built",
                        "leave out --engine, or build the engine with `enginesmith build --kv ring`")
    path = Path(args.engine) if args.engine else cached_engine(config or build_config(args))
    if check is not None:
        check(engine_dir.read_manifest(path))
    rows = max(1, len(getattr(args, "prompt", []) or []), getattr(args, "batch", 1) or 1)
    return open_engine(path, device=args.device, threads=args.threads, max_batch=rows,
                       num_pages=getattr(args, "num_pages", None),
                       gpu_memory_utilization=getattr(args, "gpu_memory_utilization", 0.9))


def sampling_params(args) -> SamplingParams:
    """Validated before any model is loaded, so a bad value fails in milliseconds (the values'
    rules live in SamplingParams and GenerationConfig; --system and --stop text must be UTF-8)."""
    if args.system is not None:
        check_text(args.system, "the --system message")
    for stop in args.stop:
        check_text(stop, "a --stop string")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling)
    return sampling


def generation_config(args, loaded, sampling: SamplingParams) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=args.max_tokens, sampling=sampling,
                            stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest),
                            stop_strings=tuple(args.stop), max_positions=loaded.context_limit)


# ----------------------------------------------------------------------------- list and file flags

def int_list(text: str, flag: str) -> list[int]:
    """"1,8,64" -> [1, 8, 64]: positive integers, each once, in the order given."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r} is not a list of integers", f"e.g. {flag} 1,8,64") from None
    if not values or any(v < 1 for v in values):
        raise UserError(f"{flag} {text!r} needs positive integers", f"e.g. {flag} 1,8,64")
    return list(dict.fromkeys(values))


def check_png(path: str, flag: str = "--png") -> None:
    """--png FILE is writable as a plot before a long run: matplotlib is there, the folder exists, the
    path names a regular file (or nothing yet)."""
    from enginesmith.measure.throughput import require_matplotlib  # deferred: imports onnxruntime (optional)

    require_matplotlib()
    check_out(path, flag, "file")
    if not Path(path).expanduser().resolve().parent.is_dir():
        raise UserError(f"{flag} {path}: its folder does not exist", "create the folder or give another path")
