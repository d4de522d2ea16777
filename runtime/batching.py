"""Continuous batching over a paged engine: requests join and leave the running batch every step.

Dimension legend: B rows this step, S = the widest row's new tokens, V vocab.

One `step()` (vLLM v1's scheduler, scaled down: one token budget, no separate prefill phase):

    running requests, in arrival order ── each gets min(remaining, chunk, budget) new tokens
        │  (decode: 1; a prompt: chunks of `chunk`); out of pages -> preempt the newest running
        │  request (free its pages, back to the front of the queue, recomputed later)
    waiting requests ── admitted while rows, budget and pages last; a prefix hit skips the cached
        │  full blocks of the prompt
    one forward: rows right-padded to S; context_lens = computed + S; pads write slot -1
        ▼
    rows whose tokens are all computed sample one token; stop token / max_new_tokens -> finished,
    pages freed at once; full blocks just written enter the prefix cache

Right padding keeps every query column at a valid position (context_lens >= S), as the TensorRT
plugin requires; the plugin also caps S at 16 (use chunk <= 16 there). A request's output does not
depend on what it was batched with (tested: equal to the request run alone, greedy).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.runtime.block_manager import KVCacheManager
from enginesmith.runtime.kv_paged import PagedKVPool, build_step
from enginesmith.runtime.sampling import SamplingParams, sample


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8      # rows per step
    max_tokens: int = 256   # new tokens per step, all rows together
    chunk: int = 64         # new tokens per row per step (prefill chunks); <= 16 for the TRT plugin

    def __post_init__(self):
        for name in ("max_batch", "max_tokens", "chunk"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"scheduler {name}={getattr(self, name)!r} must be a positive integer",
                                f"give {name} >= 1")


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    output: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the pool
    finish_reason: str | None = None    # "stop" | "length"
    prefix_hit_tokens: int = 0          # tokens taken from the prefix cache (last admission)
    preemptions: int = 0
    rng: np.random.Generator | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


@dataclass(frozen=True)
class StepOutput:
    scheduled: tuple[str, ...]             # request ids in this step's rows
    new_tokens: dict[str, int]             # request id -> token sampled this step
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    num_tokens: int                        # real new tokens computed


class ContinuousBatcher:
    """Runs many requests of different lengths through one paged engine, batch changing per step."""

    def __init__(self, engine, num_pages: int, config: SchedulerConfig | None = None,
                 enable_prefix_caching: bool = True):
        self.engine = engine
        self.config = config or SchedulerConfig()
        self.pool = PagedKVPool.for_session(engine.session, num_pages, engine.device)
        self.manager = KVCacheManager(num_pages, self.pool.page_size, enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self._ids = itertools.count()

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (),
                    sampling: SamplingParams | None = None, request_id: str | None = None) -> str:
        if len(prompt) == 0:
            raise UserError("empty prompt", "give at least one token of prompt")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise UserError(f"invalid max_new_tokens={max_new_tokens!r}", "use an integer >= 1")
        needed = -(-(len(prompt) + max_new_tokens) // self.pool.page_size)
        if needed > self.pool.num_pages - 1:
            raise UserError(f"a request of {len(prompt)} + {max_new_tokens} tokens needs {needed} pages; the pool "
                            f"has {self.pool.num_pages - 1}", "give the batcher more pages")
        rid = request_id or f"req{next(self._ids)}"
        sampling = sampling or SamplingParams()
        self.waiting.append(Request(rid, [int(t) for t in prompt], max_new_tokens, frozenset(stop_token_ids),
                                    sampling, rng=np.random.default_rng(sampling.seed)))
        return rid

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def run(self) -> dict[str, list[int]]:
        """Step until every request has finished; output token ids per request id."""
        while self.has_unfinished:
            self.step()
        return {rid: r.output for rid, r in self.finished.items()}

    # ------------------------------------------------------------------ scheduling

    def _preempt(self, victim: Request) -> None:
        self.manager.free(victim.request_id)
        victim.num_computed = 0
        victim.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def _schedule(self) -> tuple[list[Request], list[int], list, list[str]]:
        cfg = self.config
        budget = cfg.max_tokens
        rows, counts, copies, preempted = [], [], [], []
        for req in list(self.running):
            if req not in self.running or len(rows) == cfg.max_batch or budget == 0:
                continue  # preempted meanwhile, or no room left this step
            n = min(len(req.tokens) - req.num_computed, cfg.chunk, budget)
            while (blocks := self.manager.allocate_slots(req.request_id, n)) is None:
                victim = self.running[-1]  # the newest request gives its pages back
                preempted.append(victim.request_id)
                self._preempt(victim)
                if victim is req:
                    break
            if blocks is None:
                continue
            rows.append(req)
            counts.append(n)
            copies += blocks.copies
            budget -= n
        while self.waiting and not preempted and len(rows) < cfg.max_batch and budget > 0:
            req = self.waiting[0]
            hits, hit_tokens = self.manager.get_computed_blocks(req.tokens)
            n = min(len(req.tokens) - hit_tokens, cfg.chunk, budget)
            blocks = self.manager.allocate_slots(req.request_id, n, hits)
            if blocks is None:
                break  # wait for pages
            self.waiting.popleft()
            req.num_computed = req.prefix_hit_tokens = hit_tokens
            self.running.append(req)
            rows.append(req)
            counts.append(n)
            copies += blocks.copies
            budget -= n
        return rows, counts, copies, preempted

    # ------------------------------------------------------------------ one step

    def step(self) -> StepOutput:
        rows, counts, copies, preempted = self._schedule()
        if not rows:
            if self.waiting:
                raise UserError("no request fits the paged KV pool", "give the batcher more pages")
            return StepOutput((), {}, (), tuple(preempted), 0)
        width = max(counts)
        ids = np.zeros((len(rows), width), np.int64)
        for r, (req, n) in enumerate(zip(rows, counts)):
            ids[r, :n] = req.tokens[req.num_computed:req.num_computed + n]
        self.pool.copy_pages(copies)
        starts = [req.num_computed for req in rows]
        step = build_step(self.manager, [req.request_id for req in rows], starts, counts, width)
        self.pool.prepare(step)
        logits = self.engine.forward(ids, np.ones_like(ids), step.position_ids, self.pool)  # [B, S, V]
        new_tokens, finished = {}, []
        for r, (req, n) in enumerate(zip(rows, counts)):
            req.num_computed += n
            self.manager.cache_blocks(req.request_id, req.tokens, req.num_computed)
            if req.num_computed < len(req.tokens):
                continue  # mid-prompt chunk: nothing to sample yet
            seen = [np.asarray(req.tokens)] if req.sampling.repetition_penalty != 1.0 else None
            token = int(sample(logits[r, n - 1][None], req.sampling, req.rng, seen)[0])
            req.output.append(token)
            new_tokens[req.request_id] = token
            if token in req.stop_token_ids or len(req.output) >= req.max_new_tokens:
                req.finish_reason = "stop" if token in req.stop_token_ids else "length"
                self.manager.free(req.request_id)
                self.running.remove(req)
                self.finished[req.request_id] = req
                finished.append(req.request_id)
        return StepOutput(tuple(r.request_id for r in rows), new_tokens, tuple(finished), tuple(preempted),
                          int(sum(counts)))
