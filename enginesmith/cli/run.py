"""`enginesmith run`: generate from one or more prompts (one prompt streams to the terminal)."""

from __future__ import annotations

from enginesmith.cli.flags import (add_kv_flags, add_model_flags, add_sampling_flags, add_speculative_flags,
                                   generation_config, load_engine, print_speculative, sampling_params,
                                   speculative_config, speculative_decoder)
from enginesmith.runtime.text.chat import encode_prompt
from enginesmith.runtime.decoding.generate import generate, stream
from enginesmith.runtime.text.tokenizer import check_text


def add_parser(verbs) -> None:
    p = verbs.add_parser("run", help="generate from one or more prompts (one prompt streams)")
    p.add_argument("prompt", nargs="+", help="prompt text; several prompts run as one batch")
    add_model_flags(p)
    add_sampling_flags(p)
    p.add_argument("--raw", action="store_true", help="continue the text as is (no chat template)")
    add_kv_flags(p)
    add_speculative_flags(p)
    p.set_defaults(func=cmd_run)


def cmd_run(args) -> int:
    sampling = sampling_params(args)
    for prompt in args.prompt:  # before the model loads: argv bytes that are not UTF-8 arrive as surrogates
        check_text(prompt, "the prompt")
    spec = speculative_config(args)
    loaded = load_engine(args)
    config = generation_config(args, loaded, sampling)
    decoder = speculative_decoder(args, loaded, spec) if spec else None
    prompts = [encode_prompt(loaded.tokenizer, p, raw=args.raw, system=args.system,
                             special_tokens_in_text=args.allow_special_tokens_in_text) for p in args.prompt]
    if len(prompts) == 1:  # stream to the terminal as tokens arrive
        if args.raw:
            print(args.prompt[0], end="", flush=True)
        for deltas in stream(loaded.engine, loaded.tokenizer, prompts, config, loaded.pad_id, decoder):
            print(deltas[0], end="", flush=True)
        print()
    else:
        for i, done in enumerate(generate(loaded.engine, loaded.tokenizer, prompts, config, loaded.pad_id, decoder)):
            print(f"[{i}] {args.prompt[i] if args.raw else ''}{done.text}")
    if decoder:
        print_speculative(decoder)
    return 0
