"""Speculative decoding: a drafter proposes k tokens, the target checks them all in one forward.

    context ──▶ drafter.propose(k) ──▶ d1..dk
    target.forward([last, d1..dk]) ──▶ p1..p(k+1)        (S = k + 1 rows of next-token logits)
    accept d1..dn, then one token from p(n+1) ──▶ emit n + 1 tokens
    target cache.truncate(accepted prefix)   drafter.rollback(accepted prefix)

Greedy: a draft is accepted iff it is the target's argmax, so the output is the target's own greedy
output. Sampling: the rule of Leviathan et al. 2023 / Chen et al. 2023: accept d with probability
min(1, p(d) / q(d)), on the first rejection draw from norm(max(p - q, 0)), and when all k are
accepted draw a bonus token from p(k+1); every emitted token is then distributed exactly as the
target's sample would be. p and q are the distributions after temperature/top-k/top-p/penalty.
Prompt lookup (n-gram) drafts are deterministic: q is a point mass on d.

Drafters: `NgramDrafter` (prompt lookup: the text after the latest earlier occurrence of the
context's last n tokens) and `ModelDrafter` (a small engine with its own KV cache). Rollback goes
through the cache's `truncate(length)`, offered by the layouts that declare `rollback`
(protocols.KVCache: dense, paged, the CUDA engines' caches; not the ring).

Dimension legend: S tokens fed to the target in one call, V vocab. Speculation runs per sequence
(batch 1); `speculative_ids` runs the rows of a batch one after another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Iterator, Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.generate import check_budget
from enginesmith.runtime.protocols import Engine
from enginesmith.runtime.decoding.sampling import SamplingParams, apply_repetition_penalty, probabilities


@dataclass(frozen=True)
class SpeculativeConfig:
    k: int = 4               # draft tokens per target call; the upper bound when adaptive
    adaptive: bool = True    # +2 after a fully accepted draft, -1 after a rejection (within 1..k)
    max_ngram: int = 3       # prompt lookup: longest context suffix searched for
    min_ngram: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k < 1:
            raise UserError(f"invalid speculative k={self.k!r}", "use an integer k >= 1 (draft tokens per target call)")
        if not (isinstance(self.min_ngram, int) and isinstance(self.max_ngram, int)
                and 1 <= self.min_ngram <= self.max_ngram):
            raise UserError(f"invalid n-gram sizes min={self.min_ngram!r} max={self.max_ngram!r}",
                            "use integers 1 <= min_ngram <= max_ngram")


@dataclass
class SpeculativeStats:
    new_tokens: int = 0
    target_calls: int = 0   # target forwards, the prefill included (plain decoding: one per token)
    draft_calls: int = 0
    proposed: int = 0       # draft tokens sent to the target
    accepted: int = 0
    k_history: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.proposed if self.proposed else None

    @property
    def tokens_per_target_call(self) -> float | None:
        return self.new_tokens / self.target_calls if self.target_calls else None

    def to_json(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k != "k_history"}
        out.update(acceptance_rate=self.acceptance_rate, tokens_per_target_call=self.tokens_per_target_call,
                   mean_k=float(np.mean(self.k_history)) if self.k_history else None)
        return out


def _draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from probs [V] by inverse CDF (one uniform), as sampling.sample draws."""
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), probs.shape[-1] - 1))


def _distribution(logits: np.ndarray, params: SamplingParams, seen: np.ndarray) -> np.ndarray:
    """probs [V] that plain sampling would draw from after `seen` (prompt + output so far)."""
    track = [seen] if params.repetition_penalty != 1.0 else None
    return probabilities(logits[None], params, track)[0]


def _greedy(logits: np.ndarray, params: SamplingParams, seen: np.ndarray) -> int:
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits[None], [seen], params.repetition_penalty)[0]
    return int(np.argmax(logits))


# ----------------------------------------------------------------------------- drafters

class NgramDrafter:
    """Prompt lookup: propose the tokens that followed the latest earlier occurrence of the
    context's last n tokens (n from max_ngram down to min_ngram); nothing when there is none."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.vocab = None  # any vocabulary

    def reset(self, prompt: np.ndarray) -> None:
        pass

    def propose(self, context: np.ndarray, k: int, params: SamplingParams, rng, stats: SpeculativeStats
                ) -> tuple[list[int], list[np.ndarray] | None]:
        """(draft tokens, their draft distributions q or None for a point mass)."""
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(context[:-1], n)  # earlier n-grams
            hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return [int(t) for t in context[start:start + k]], None
        return [], None

    def rollback(self, valid: int) -> None:
        pass


class ModelDrafter:
    """A draft engine (same vocabulary as the target) with its own KV cache: it decodes k tokens
    autoregressively from the context; its cache is caught up and rolled back to match."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.vocab = engine.vocab
        self.cache = None
        self.length = 0  # leading context tokens held in the draft cache

    def reset(self, prompt: np.ndarray) -> None:
        self.cache = self.engine.new_cache(1)
        self.length = 0

    def propose(self, context: np.ndarray, k: int, params: SamplingParams, rng, stats: SpeculativeStats
                ) -> tuple[list[int], list[np.ndarray] | None]:
        logits = _forward(self.engine, self.cache, context[self.length:], self.length)[-1]
        stats.draft_calls += 1
        self.length = len(context)
        tokens: list[int] = []
        qs: list[np.ndarray] = []
        seen = context
        for i in range(k):
            if params.greedy:
                token = _greedy(logits, params, seen)
            else:
                q = _distribution(logits, params, seen)
                token = _draw(q, rng)
                qs.append(q)
            tokens.append(token)
            if i == k - 1:
                break
            if params.repetition_penalty != 1.0:
                seen = np.append(seen, token)
            logits = _forward(self.engine, self.cache, np.array([token]), self.length)[-1]
            stats.draft_calls += 1
            self.length += 1
        return tokens, (qs if not params.greedy else None)

    def rollback(self, valid: int) -> None:
        if self.length > valid:
            self.cache.truncate(valid)
            self.length = valid


def draft_model(spec: str) -> str | None:
    """The PATH of `draft:PATH` (an engine directory or a model spec), None for `ngram`; a
    UserError for anything else. A model spec is built by the caller (the CLI: cached_engine)."""
    if spec == "ngram":
        return None
    kind, sep, path = spec.partition(":")
    if kind != "draft" or not sep or not path:
        raise UserError(f"unknown speculative mode {spec!r}", "use --speculative ngram or --speculative draft:PATH")
    return path


def check_compatible(draft_vocab: int, target_vocab: int, draft_tokenizer=None, target_tokenizer=None) -> None:
    """Draft and target must share one vocabulary: same size and, when known, the same tokens."""
    if draft_vocab != target_vocab:
        raise UserError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
                        f"({target_vocab})", "use a draft model with the target's tokenizer, or --speculative ngram")
    if draft_tokenizer is not None and target_tokenizer is not None \
            and _fingerprint(draft_tokenizer) != _fingerprint(target_tokenizer):
        raise UserError("the draft model's tokenizer maps tokens to different ids than the target's",
                        "use a draft model with the target's tokenizer, or --speculative ngram")


_PROBE = "The quick brown fox, 1234 café ∑ <|im_start|> naïve Übermaß 東京 \n\t end."


def _fingerprint(tokenizer) -> tuple:
    """Vocabulary size and the ids of a probe text: equal for tokenizers that map text alike."""
    return len(tokenizer), tuple(tokenizer.encode(_PROBE, add_special_tokens=False))


# ----------------------------------------------------------------------------- the loop

def _forward(engine, cache, ids: np.ndarray, past: int) -> np.ndarray:
    """Logits [S, V] of `ids` [S] after `past` cached tokens (batch 1, no padding)."""
    seq = len(ids)
    mask = np.ones((1, past + seq), dtype=np.int64)
    pos = np.arange(past, past + seq, dtype=np.int64)[None]
    return engine.forward(np.asarray(ids, dtype=np.int64)[None], mask, pos, cache)[0]


def _verify(rows: np.ndarray, drafts: list[int], qs: list[np.ndarray] | None, params: SamplingParams,
            rng: np.random.Generator, context: np.ndarray) -> tuple[int, int]:
    """(accepted drafts n, the token after them) from target logits rows [k+1, V]."""
    seen = context
    for i, d in enumerate(drafts):
        if params.greedy:
            best = _greedy(rows[i], params, seen)
            if best != d:
                return i, best
        else:
            p = _distribution(rows[i], params, seen)
            q_d = qs[i][d] if qs is not None else 1.0
            if not rng.random() < p[d] / q_d:   # reject: draw from the residual max(p - q, 0)
                residual = np.maximum(p - qs[i], 0.0) if qs is not None else p.copy()
                if qs is None:
                    residual[d] = 0.0
                return i, _draw(residual if residual.sum() > 0 else p, rng)
        if params.repetition_penalty != 1.0:
            seen = np.append(seen, d)
    last = rows[len(drafts)]
    token = _greedy(last, params, seen) if params.greedy else _draw(_distribution(last, params, seen), rng)
    return len(drafts), token


def speculative_tokens(target: Engine, drafter, prompt: Sequence[int], config, spec: SpeculativeConfig,
                       stats: SpeculativeStats | None = None) -> Iterator[int]:
    """Yield the new tokens of one sequence (config: generate.GenerationConfig), stopping after a
    stop token or the budget, exactly as plain decoding would."""
    stats = stats if stats is not None else SpeculativeStats()
    if drafter.vocab not in (None, target.vocab):  # None: the n-gram drafter takes any vocabulary
        check_compatible(drafter.vocab, target.vocab)
    budget = check_budget([len(prompt)], config.max_new_tokens, config.max_positions)
    params = config.sampling
    rng = np.random.default_rng(params.seed)
    stop = set(config.stop_token_ids)
    context = np.asarray(prompt, dtype=np.int64)
    cache = target.new_cache(1)
    if not cache.rollback:  # fail before decoding
        raise UserError(f"the {type(cache).__name__} KV cache has no rollback (truncate)",
                        "use a KV layout with rollback (dense, paged) or run without --speculative")
    drafter.reset(context)
    # A device engine can verify greedy drafts without moving logits to the host (argmax per row).
    on_device = params.greedy and params.repetition_penalty == 1.0 and target.device_decode
    if on_device:
        token = int(target.greedy_forward(context, cache)[-1])
    else:
        logits = _forward(target, cache, context, 0)[-1]
        token = _greedy(logits, params, context) if params.greedy else _draw(_distribution(logits, params, context), rng)
    stats.target_calls += 1
    cached = len(context)  # target cache holds context[:cached]
    k = spec.k
    produced = 0
    while True:
        context = np.append(context, token)
        produced += 1
        stats.new_tokens += 1
        yield token
        if token in stop or produced >= budget:
            return
        room = budget - produced  # tokens we may still emit; a call emits at most k + 1
        kk = min(k, room - 1)
        drafts, qs = drafter.propose(context, kk, params, rng, stats) if kk > 0 else ([], None)
        feed = context[cached:].tolist() + drafts
        stats.target_calls += 1
        stats.proposed += len(drafts)
        stats.k_history.append(len(drafts))
        skip = len(context) - cached - 1  # row skip + i predicts the token after context + drafts[:i]
        if on_device:
            best = target.greedy_forward(feed, cache)[skip:]
            accepted = next((i for i, d in enumerate(drafts) if best[i] != d), len(drafts))
            token = int(best[accepted])
        else:
            rows = _forward(target, cache, np.asarray(feed), cached)[skip:]
            accepted, token = _verify(rows, drafts, qs, params, rng, context)
        stats.accepted += accepted
        cached = len(context) + accepted
        cache.truncate(cached)
        drafter.rollback(cached)
        for d in drafts[:accepted]:  # emit the accepted drafts; `token` is emitted at the loop top
            context = np.append(context, d)
            produced += 1
            stats.new_tokens += 1
            yield d
            if d in stop or produced >= budget:
                return
        if spec.adaptive and drafts:
            k = min(spec.k, k + 2) if accepted == len(drafts) else max(1, k - 1)


def speculative_ids(target: Engine, prompts: Sequence[Sequence[int]], config, pad_id: int = 0, *, drafter,
                    spec: SpeculativeConfig, stats: SpeculativeStats | None = None
                    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Drop-in for generate.generate_ids: (next ids [B], finished-before-this-step [B]) per step.

    Rows are decoded one after another (speculation is per sequence) and their tokens zipped
    into steps; a finished row repeats its last token, which callers ignore."""
    budget = check_budget([len(p) for p in prompts], config.max_new_tokens, config.max_positions)
    if len(prompts) > 1:  # one budget for all rows, as generate_ids
        config = replace(config, max_new_tokens=budget)
    rows = [list(speculative_tokens(target, drafter, p, config, spec, stats)) for p in prompts]
    stop = set(config.stop_token_ids)
    finished = np.zeros(len(rows), dtype=bool)
    for step in range(max(len(r) for r in rows)):
        ids = np.array([r[min(step, len(r) - 1)] for r in rows], dtype=np.int64)
        yield ids, finished.copy()
        finished |= np.array([step >= len(r) - 1 or r[step] in stop for r in rows])
        if finished.all():
            return


class SpeculativeDecoder:
    """A `generate_ids`-shaped callable (engine, prompts, config, pad_id) for generate.stream."""

    def __init__(self, drafter, spec: SpeculativeConfig | None = None) -> None:
        self.drafter = drafter
        self.spec = spec or SpeculativeConfig()
        self.stats = SpeculativeStats()

    def __call__(self, engine, prompts, config, pad_id: int = 0):
        return speculative_ids(engine, prompts, config, pad_id, drafter=self.drafter, spec=self.spec,
                               stats=self.stats)
