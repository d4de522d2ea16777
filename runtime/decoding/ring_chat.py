"""A chat session that keeps one KV cache across turns: with a ring cache it runs forever in
constant memory (StreamingLLM), each turn feeding only its own tokens.

    session = ChatSession(loaded.engine, loaded.tokenizer, config, system=None)
    for delta in session.turn("Hello"):   # text deltas of the reply
        print(delta, end="")

Turn tokens come from the tokenizer's chat template: the first turn is the template of
[system?, user] with the generation prompt; a later turn is what the template writes after an
assistant reply (its closing, e.g. "<|im_end|>\\n") followed by the new user message and the
generation prompt. The reply's last sampled token is not in the cache yet: a stop token is
re-rendered by that closing text, any other token is fed first. Nothing grows with the session
but the cache's own counters: the session keeps no history.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterator

from enginesmith.core.errors import UserError
from enginesmith.runtime.text.chat import TextGuard, check_messages, render_chat
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids, stream

_PROBE = ("\u2063probe-user\u2063", "\u2063probe-reply\u2063")


def later_turn_text(tokenizer, message: str) -> str:
    """What the chat template writes after an assistant reply's content for a new user `message`."""
    user, reply = _PROBE
    before = render_chat(tokenizer, [{"role": "user", "content": user}, {"role": "assistant", "content": reply}], False)
    after = render_chat(tokenizer, [{"role": "user", "content": user}, {"role": "assistant", "content": reply},
                                {"role": "user", "content": message}], True)
    if not after.startswith(before[:before.rindex(reply) + len(reply)]):
        raise UserError("this chat template rewrites earlier turns", "use the dense KV layout for chat")
    return after[before.rindex(reply) + len(reply):]


@dataclass
class TurnStats:
    prompt_tokens: int
    reply_tokens: int
    finish_reason: str | None


class ChatSession:
    def __init__(self, engine, tokenizer, config: GenerationConfig, system: str | None = None,
                 pad_id: int = 0, *, special_tokens_in_text: bool = False):
        """`special_tokens_in_text`: as in chat.encode_chat (False: special-token text in the
        messages is encoded as text, never as control tokens)."""
        self.engine, self.tokenizer, self.config = engine, tokenizer, config
        self.system, self.pad_id = system, pad_id
        self.special_tokens_in_text = special_tokens_in_text
        self.cache = engine.new_cache(1)
        self._unfed: int | None = None   # the last reply token, not yet in the cache
        self._ended_by_stop = False
        self.turns = 0
        self.generated = 0
        self.last: TurnStats | None = None

    def _turn_ids(self, message: str) -> list[int]:
        first = self.turns == 0
        messages = ([{"role": "system", "content": self.system}] if self.system and first else []) + \
            [{"role": "user", "content": message}]
        check_messages(messages)
        guard = None if self.special_tokens_in_text else TextGuard(self.tokenizer)
        if guard:
            messages = guard.hide(messages)
        if first:
            text = render_chat(self.tokenizer, messages, True)
        else:
            text = later_turn_text(self.tokenizer, messages[-1]["content"])
        ids = guard.encode(text) if guard else self.tokenizer.encode(text, add_special_tokens=False)
        if first:
            return ids
        if self._unfed is not None and not self._ended_by_stop:
            ids = [self._unfed] + ids
        return ids

    def turn(self, message: str) -> Iterator[str]:
        """Stream the reply to `message` as text deltas; the cache keeps the whole exchange."""
        if not message:
            raise UserError("empty message", "type some text")
        ids = self._turn_ids(message)
        decoder = partial(generate_ids, cache=self.cache)
        gen = stream(self.engine, self.tokenizer, [ids], self.config, self.pad_id, decoder)
        while True:
            try:
                deltas = next(gen)
            except StopIteration as end:
                done = end.value[0]
                break
            yield deltas[0]
        self.turns += 1
        self.generated += len(done.token_ids)
        self._unfed = done.token_ids[-1] if done.token_ids else None
        self._ended_by_stop = bool(done.token_ids) and done.token_ids[-1] in set(self.config.stop_token_ids)
        self.last = TurnStats(len(ids), len(done.token_ids), done.finish_reason)
