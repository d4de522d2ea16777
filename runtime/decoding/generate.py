"""Generation over an Engine: prefill, decode loop, streaming, stop tokens and strings, batches.

Dimension legend: B batch, S new tokens this step, P cached positions, T = P + S, V vocab.
Batches are left-padded: pad slots have attention_mask 0 and every row's positions start at 0
at its first real token, so a padded row computes exactly what it would compute alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.lockstep import batched_ids
from enginesmith.runtime.protocols import Engine, KVCache
from enginesmith.runtime.decoding.sampling import SamplingParams, sample

MAX_NEW_TOKENS = 1 << 20  # a bound on one request's work; a ring-cache stream can still run this long


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_positions: int | None = None  # the model's context; prompt + output never exceed it

    def __post_init__(self) -> None:
        """max_new_tokens is checked here, once, for every caller: a UserError with its valid range."""
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) or \
                not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS:
            raise UserError(f"invalid max_new_tokens={self.max_new_tokens!r}",
                            f"use an integer in [1, {MAX_NEW_TOKENS}]")


def check_budget(prompt_lens: Sequence[int], max_new_tokens: int, context_limit: int | None,
                 past: int = 0) -> int:
    """The new tokens a batch may generate: max_new_tokens, cut so that `past` cached tokens +
    the longest prompt + its output fit `context_limit` (None: no limit, e.g. a ring cache).
    One UserError, for every decode loop, on an empty prompt or one that leaves no room."""
    if not prompt_lens or any(n == 0 for n in prompt_lens):
        raise UserError("empty prompt", "give at least one token of prompt")
    if context_limit is None:
        return max_new_tokens
    longest = max(prompt_lens)
    if past + longest >= context_limit:
        raise UserError(f"prompt of {longest} tokens does not fit the model's context of "
                        f"{context_limit} tokens", "shorten the prompt")
    return min(max_new_tokens, context_limit - past - longest)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [B, S] and mask [B, S], each prompt right-aligned."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(prompts), width), dtype=np.int64)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            ids[row, width - len(prompt):] = prompt
            mask[row, width - len(prompt):] = 1
    return ids, mask


def positions(mask: np.ndarray, new: int) -> np.ndarray:
    """Positions of the last `new` slots of mask [B, T]: count of real tokens before each, >= 0."""
    return np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, -new:]


def generate_ids(engine: Engine, prompts: Sequence[Sequence[int]], config: GenerationConfig,
                 pad_id: int = 0, cache: KVCache | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield (next ids [B], finished-before-this-step [B] bool) per decode step.

    Rows finished by a stop token keep running (fed their stop token) until all rows are done;
    their later ids are to be ignored by the caller. `cache` continues a cache that already holds
    a session's tokens (its `length` of them count as context; one row, or rows kept in step);
    the last yielded token is not fed to it.
    """
    past = cache.length if cache is not None else 0
    if getattr(engine, "is_paged_model", False):  # the CUDA paged engine: through the scheduler
        budget = check_budget([len(p) for p in prompts], config.max_new_tokens, config.max_positions)
        yield from batched_ids(engine, prompts, budget, config.stop_token_ids, config.sampling, engine.max_batch)
        return
    budget = check_budget([len(p) for p in prompts], config.max_new_tokens, config.max_positions, past)
    rng = np.random.default_rng(config.sampling.seed)
    stop = np.array(sorted(set(config.stop_token_ids)), dtype=np.int64)
    ids, mask = left_pad(prompts, pad_id)
    seen = [np.asarray(p, dtype=np.int64) for p in prompts]
    if cache is None:
        cache = engine.new_cache(len(prompts))
    else:
        mask = np.concatenate([np.ones((len(prompts), past), dtype=np.int64), mask], axis=1)
    logits = engine.forward(ids, mask, positions(mask, ids.shape[1]), cache)[:, -1]  # [B, V]
    finished = np.zeros(len(prompts), dtype=bool)
    for step in range(budget):
        track = seen if config.sampling.repetition_penalty != 1.0 else None
        next_ids = sample(logits, config.sampling, rng, track)  # [B]
        yield next_ids, finished.copy()
        finished |= np.isin(next_ids, stop)
        if finished.all() or step == budget - 1:
            return
        if track is not None:
            seen = [np.append(s, t) for s, t in zip(seen, next_ids)]
        mask = np.concatenate([mask, np.ones((len(prompts), 1), dtype=np.int64)], axis=1)
        logits = engine.forward(next_ids[:, None], mask, positions(mask, 1), cache)[:, 0]


class IncrementalDetokenizer:
    """Text deltas from a growing list of ids, never splitting a multi-byte character."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already emitted (context for spacing)
        self.read = 0

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix:self.read], skip_special_tokens=True)
        after = decode(self.ids[self.prefix:], skip_special_tokens=True)
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # "stop" (token or string) | "length"


def stream(engine: Engine, tokenizer, prompts: Sequence[Sequence[int]], config: GenerationConfig,
           pad_id: int = 0, decoder=None) -> Iterator[list[str]]:
    """Yield per step one text delta per row ("" when nothing new); see `generate` for results.

    `decoder` replaces `generate_ids` (same signature and yields), e.g. a
    speculative.SpeculativeDecoder. The final Completion objects are the generator's return value.
    """
    rows = len(prompts)
    detok = [IncrementalDetokenizer(tokenizer) for _ in range(rows)]
    done = [Completion() for _ in range(rows)]
    held = [""] * rows  # text held back while it may be the start of a stop string
    hold = max((len(s) for s in config.stop_strings), default=1) - 1
    stop_ids = set(config.stop_token_ids)
    for next_ids, _ in (decoder or generate_ids)(engine, prompts, config, pad_id):
        deltas = [""] * rows
        for row, token in enumerate(next_ids.tolist()):
            c = done[row]
            if c.finish_reason:
                continue
            c.token_ids.append(token)
            if token in stop_ids:
                c.finish_reason = "stop"
                deltas[row], held[row] = held[row], ""
                c.text += deltas[row]
                continue
            pending = held[row] + detok[row].push(token)
            cut = _first_stop(c.text + pending, config.stop_strings, len(c.text))
            if cut is not None:
                pending, c.finish_reason = (c.text + pending)[len(c.text):cut], "stop"
                deltas[row], held[row] = pending, ""
            else:
                keep = len(pending) - hold if hold else len(pending)
                deltas[row], held[row] = pending[:max(keep, 0)], pending[max(keep, 0):]
            c.text += deltas[row]
        yield deltas
    tail = [""] * rows
    for row, c in enumerate(done):
        if c.finish_reason is None:
            c.finish_reason = "length"
            tail[row], held[row] = held[row], ""
            c.text += tail[row]
    if any(tail):
        yield tail
    return done


def _first_stop(text: str, stop_strings: Sequence[str], start: int) -> int | None:
    """Index in text where the earliest stop string begins, searching from near `start`."""
    hits = [i for s in stop_strings if s and (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def generate(engine: Engine, tokenizer, prompts: Sequence[Sequence[int]], config: GenerationConfig,
             pad_id: int = 0, decoder=None) -> list[Completion]:
    """Run `stream` to the end and return one Completion per prompt."""
    gen = stream(engine, tokenizer, prompts, config, pad_id, decoder)
    while True:
        try:
            next(gen)
        except StopIteration as end:
            return end.value
