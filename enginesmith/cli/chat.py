"""`enginesmith chat`: an interactive chat that streams its answers, and the REPL it runs in.

With a dense or paged cache the history is re-encoded each turn (the oldest turns dropped when it
outgrows the context); with a ring cache one session runs in constant memory and keeps no history.
"""

from __future__ import annotations

import sys

from enginesmith.cli.flags import (add_kv_flags, add_model_flags, add_sampling_flags, generation_config,
                                   load_engine, sampling_params)
from enginesmith.core.errors import UserError
from enginesmith.runtime.text.chat import encode_chat
from enginesmith.runtime.decoding.generate import stream
from enginesmith.runtime.decoding.ring_chat import ChatSession


def add_parser(verbs) -> None:
    p = verbs.add_parser("chat", help="interactive chat that streams its answers")
    add_model_flags(p)
    add_sampling_flags(p)
    add_kv_flags(p)
    p.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    sampling = sampling_params(args)
    loaded = load_engine(args)
    config = generation_config(args, loaded, sampling)
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
