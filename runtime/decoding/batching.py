"""Continuous batching over a paged engine: requests join and leave the running batch every step.

Dimension legend: B rows this step, S = the widest row's new tokens, V vocab.

One `step()` (vLLM v1's scheduler, scaled down: one token budget, no separate prefill phase):

    cancelled requests leave (pages back to the pool)
    running requests, in arrival order ── each gets min(remaining, chunk, budget) new tokens
        │  (decode: 1; a prompt: chunks of `chunk`); out of pages -> preempt the newest running
        │  request (free its pages, back to the front of the queue, recomputed later)
    waiting requests ── admitted while rows, budget and pages last: admission by the pages a request
        │  needs (prompt + min(max_new_tokens, reserve_new_tokens)), counted against the free pages
        │  less what the running requests may still take, so the admitted ones finish without
        │  preemption; one that does not fit waits, one that never could is refused when added; a
        │  prefix hit skips the cached full blocks of the prompt
    one forward (`PagedModel.run`): rows right-padded to S; context_lens = computed + S; pads
        │  write slot -1; the model samples one token for each row whose prompt is all computed,
        ▼  with that request's sampling parameters (on the device for the CUDA engine)
    stop token / stop string / max_new_tokens -> finished, pages freed at once; full blocks just
    written enter the prefix cache

Async scheduling (`SchedulerConfig.async_steps`, runtime/decoding/step_pipeline.py): one step stays in flight.
While step n runs, the next is scheduled as if every row of n goes on (a row that samples at n has one
token pending: its slot is allocated, its input id is a hole); when n's tokens come back the holes are
filled and n + 1 is launched at once; only then are n's tokens processed. So `step()` still returns
the tokens of one completed step, and a request's tokens are those of sync scheduling:
    a row whose max_new_tokens is reached by its pending token is not scheduled again;
    a row that stops (stop token or string) or is cancelled while in the launched step: that step's
        token for it is dropped, and its pages go back only once the step has run (no page is reused
        while a step that writes it is in flight);
    preemption first waits for the step in flight (its pages are then safe to hand over);
    full blocks enter the prefix cache once the step that wrote them has run.

Right padding keeps every query column at a valid position (context_lens >= S), as the paged
kernels require; it also means a row reaches position computed + S - 1 with padding, so a request
must leave `chunk - 1` positions of the model's context free (checked when it is added).

A request's output does not depend on what it was batched with: greedy is the argmax of its own
logits, and a sampled token is drawn with noise keyed by (the request's seed, the token's index),
not by a generator shared with batch-mates (tested: equal to the request run alone).

`PagedModel` is what the scheduler drives: `engines/ort_paged_model.OrtPagedModel` (any ONNX Runtime paged graph,
sampling on the host) and `paged_cuda.PagedCudaEngine` (the CUDA paged engine, sampling on the device).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.core.kv_layout import PagedStep, paged_step
from enginesmith.runtime.kv.block_manager import KVCacheManager
from enginesmith.runtime.decoding.sampling import SamplingParams
from enginesmith.runtime.decoding.step_pipeline import InFlight, StepPipeline


@dataclass(frozen=True)
class Pick:
    """Sample one token from row `row`, column `col` of this step's logits."""

    row: int
    col: int
    sampling: SamplingParams
    seed: int              # the request's seed: the noise of token `index` is keyed by (seed, index)
    index: int             # the output token's index in its request
    history: Sequence[int] | None = None  # the request's tokens so far (repetition penalty only)


class PagedModel(Protocol):
    """A paged engine and its page pool, as the scheduler drives it."""

    num_pages: int            # pages in the pool (page 0 is the null page)
    page_size: int
    max_chunk: int | None     # new tokens per row per step the attention takes (None: any)
    max_positions: int | None  # positions a row may reach (its block table's reach; None: no bound)

    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy-on-write: page dst takes page src's contents in every layer."""

    def run(self, ids: np.ndarray, step: PagedStep, picks: Sequence[Pick]) -> list[int]:
        """One forward of ids [B, S] over `step`, then one token per pick."""

    # Optional: async_steps (bool: the default of SchedulerConfig.async_steps for this model); kv_window
    # (int: every layer attends to its last kv_window positions, pages behind go back: block_manager.py);
    # launch_returns_early with launch(ids, step, picks) -> a handle whose result() is run's tokens.


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8      # rows per step
    max_tokens: int = 256   # new tokens per step, all rows together
    chunk: int = 64         # new tokens per row per step (prefill chunks); capped by the model's max_chunk
    async_steps: bool | None = None  # schedule step n+1 while step n runs; None: the model's `async_steps`
    reserve_new_tokens: int = 1024  # output tokens of a request whose pages are reserved at admission

    def __post_init__(self):
        for name in ("max_batch", "max_tokens", "chunk", "reserve_new_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise UserError(f"scheduler {name}={getattr(self, name)!r} must be a positive integer",
                                f"give {name} >= 1")
        if self.async_steps not in (None, True, False):
            raise UserError(f"scheduler async_steps={self.async_steps!r} must be True, False or None",
                            "give a bool (None: the engine's default)")


@dataclass(eq=False)  # compared by identity: the scheduler's list operations stay O(1) per compare
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    output: list[int] = field(default_factory=list)
    num_computed: int = 0               # tokens whose K/V are in the pool
    finish_reason: str | None = None    # "stop" | "length" | "cancelled"
    stop_reason: int | str | None = None  # the stop token or stop string that ended it
    prefix_hit_tokens: int = 0          # tokens taken from the prefix cache (last admission)
    preemptions: int = 0
    added_at: float = 0.0               # time.perf_counter() when added
    first_token_at: float | None = None
    finished_at: float | None = None
    tokens: list[int] = field(default_factory=list)  # prompt + output (kept, not rebuilt per access)

    def __post_init__(self):
        self.tokens = self.prompt + self.output

    def append(self, token: int) -> None:
        self.output.append(token)
        self.tokens.append(token)


@dataclass(frozen=True)
class StepOutput:
    scheduled: tuple[str, ...]             # request ids in this step's rows
    new_tokens: dict[str, int]             # request id -> token sampled this step
    finished: tuple[str, ...]
    preempted: tuple[str, ...]
    num_tokens: int                        # real new tokens computed
    width: int = 0                         # S: columns of this step's rows
    pages_used: int = 0                    # pages held after the step (null page not counted)
    seconds: float = 0.0                   # wall time of the step (async: from the previous step's tokens to these)
    context_tokens: int = 0                # KV positions the step's rows attend over (sum of context lengths)


@dataclass
class _Forward:
    """One model forward of a step: its inputs, the requests its picks sample for, and the input ids
    still unknown when it was prepared: (row, column, request, position in request.tokens)."""

    ids: np.ndarray                 # [B, S] int64
    step: PagedStep
    picks: list[Pick]
    sampled: list[Request]          # one per pick
    holes: list[tuple[int, int, Request, int]]


@dataclass(eq=False)
class _Step:
    """A scheduled step, from its preparation to the processing of its tokens."""

    rows: list[Request]
    counts: list[int]
    ends: list[int]                 # each row's num_computed once the step has run
    copies: list
    forwards: list[_Forward]
    width: int
    context: int                    # sum of the rows' context lengths
    since: float = 0.0              # launched at, or (pipelined) when the step before it came back
    tokens_at: float = 0.0          # when its tokens came back
    inflight: InFlight | None = None
    free_after: list[str] = field(default_factory=list)  # requests that ended under it: pages freed once it ran
    accepted: list[tuple[Request, int]] = field(default_factory=list)  # tokens appended to their requests
    members: set = field(init=False)   # its rows (a request in it may not give its pages back)
    sampling: set = field(init=False)  # the requests it samples a token for

    def __post_init__(self):
        self.members = set(self.rows)
        self.sampling = {req for fwd in self.forwards for req in fwd.sampled}


class ContinuousBatcher:
    """Runs many requests of different lengths through one paged model, batch changing per step.

    Single-threaded: call add_request / cancel / step from one thread (a server's loop thread); with
    async steps the model runs off that thread (runtime/decoding/step_pipeline.py), one step at a time."""

    def __init__(self, model: PagedModel, config: SchedulerConfig | None = None,
                 enable_prefix_caching: bool = True, decode: Callable[[Sequence[int]], str] | None = None):
        self.model = model
        self.config = config or SchedulerConfig()
        self.chunk = min(self.config.chunk, model.max_chunk or self.config.chunk)
        self.manager = KVCacheManager(model.num_pages, model.page_size, enable_prefix_caching,
                                      getattr(model, "kv_window", None))
        self.decode = decode  # token ids -> text: needed for stop strings
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self._live: dict[str, Request] = {}  # waiting and running requests by id (lookups once per token)
        self._cancelled: set[str] = set()
        self._ids, self._seeds = itertools.count(), np.random.SeedSequence()
        chosen = self.config.async_steps
        self.async_steps = bool(getattr(model, "async_steps", False) if chosen is None else chosen)
        self.pipeline = StepPipeline(model, self.async_steps)
        self._inflight: _Step | None = None  # launched, tokens not back yet
        self._ready: _Step | None = None     # tokens back, not processed yet
        self.solo: Request | None = None     # when set, steps schedule this request alone (see recover())

    def check_request(self, prompt: Sequence[int], max_new_tokens: int, stop_strings: Sequence[str] = ()) -> None:
        """UserError for a request this batcher could never run (reads only fixed settings: any thread)."""
        if len(prompt) == 0:
            raise UserError("empty prompt", "give at least one token of prompt")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise UserError(f"invalid max_new_tokens={max_new_tokens!r}", "use an integer >= 1")
        if stop_strings and self.decode is None:
            raise UserError("stop strings need the tokenizer", "make the batcher with decode=tokenizer.decode")
        if any(not isinstance(s, str) or not s for s in stop_strings):
            raise UserError("a stop string is empty or not text", "give non-empty strings")
        total = len(prompt) + max_new_tokens
        limit = self.model.max_positions
        if limit is not None and total + self.chunk - 1 > limit:
            raise UserError(f"a request of {len(prompt)} + {max_new_tokens} tokens exceeds the engine's "
                            f"{limit} positions (less {self.chunk - 1} for the padding of a "
                            "step)", "use a shorter prompt or fewer new tokens")
        needed = self.manager.pages_for(total, self.chunk)
        if needed > self.model.num_pages - 1:
            raise UserError(f"a request of {len(prompt)} + {max_new_tokens} tokens needs {needed} pages; the pool "
                            f"has {self.model.num_pages - 1}", "give the batcher more pages")

    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (),
                    sampling: SamplingParams | None = None, request_id: str | None = None,
                    stop_strings: Sequence[str] = ()) -> str:
        self.check_request(prompt, max_new_tokens, stop_strings)
        rid = request_id or f"req{next(self._ids)}"
        if rid in self.finished or rid in self._live:
            raise UserError(f"request id {rid!r} is already in use", "give each request its own id")
        sampling = sampling or SamplingParams()
        seed = sampling.seed if sampling.seed is not None else int(self._seeds.spawn(1)[0].generate_state(1)[0])
        req = Request(rid, [int(t) for t in prompt], max_new_tokens, frozenset(stop_token_ids), tuple(stop_strings),
                      sampling, seed, added_at=time.perf_counter())
        self.waiting.append(req)
        self._live[rid] = req
        return rid

    def cancel(self, request_id: str) -> bool:
        """End a waiting or running request at the next step (its pages go back then); False if unknown
        or already finished."""
        if request_id in self._live:
            self._cancelled.add(request_id)
            return True
        return False

    def request(self, request_id: str) -> Request:
        """The request of that id, waiting, running or finished (KeyError if unknown)."""
        req = self._live.get(request_id) or self.finished.get(request_id)
        if req is None:
            raise KeyError(request_id)
        return req

    @property
    def has_unfinished(self) -> bool:
        """Requests wait or run, or a step is still in flight (step() until False: nothing is lost)."""
        return bool(self.waiting or self.running) or self._inflight is not None or self._ready is not None

    @property
    def pages_used(self) -> int:
        return self.model.num_pages - 1 - self.manager.num_free_blocks

    def run(self) -> dict[str, list[int]]:
        """Step until every request has finished; output token ids per request id."""
        while self.has_unfinished:
            self.step()
        return {rid: r.output for rid, r in self.finished.items()}

    def close(self) -> None:
        """Wait for the step in flight and process its tokens (no StepOutput: step() until not
        has_unfinished to see every token), then end the worker thread. Stepping again is allowed."""
        self._complete()
        if self._ready is not None:
            done, self._ready = self._ready, None
            self._process(done, [], [], time.perf_counter())
        self.pipeline.close()

    # ------------------------------------------------------------------ scheduling

    def _finish(self, req: Request, reason: str, stop=None) -> None:
        req.finish_reason, req.stop_reason, req.finished_at = reason, stop, time.perf_counter()
        if req is self.solo:
            self.solo = None
        if req.request_id in self.manager.seqs:
            if self._inflight is not None and req in self._inflight.members:
                self._inflight.free_after.append(req.request_id)  # the step in flight still writes its pages
            else:
                self.manager.free(req.request_id)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(req)
        self._live.pop(req.request_id, None)
        self.finished[req.request_id] = req

    def _drop_cancelled(self) -> list[str]:
        if not self._cancelled:
            return []
        gone = []
        for req in [r for r in itertools.chain(self.waiting, self.running) if r.request_id in self._cancelled]:
            if req in self.waiting:
                self.waiting.remove(req)
            self._finish(req, "cancelled")
            gone.append(req.request_id)
        self._cancelled.clear()
        return gone

    def _preempt(self, victim: Request) -> None:
        assert self._inflight is None, "pages must not be handed over while a step may write them"
        self.manager.free(victim.request_id)
        victim.num_computed = 0
        victim.preemptions += 1
        self.running.remove(victim)
        self.waiting.appendleft(victim)

    def recover(self) -> list[str]:
        """After step() raised (the engine failed): nothing stays in flight, and every running request
        gives its pages back and waits to be recomputed from its tokens so far (as if preempted).
        Returns their ids, in arrival order: the requests the failed step may have run. A caller that
        sets `solo` to one of them then steps it alone (the others wait) to find the one at fault."""
        self._inflight = self._ready = None
        suspects = [req.request_id for req in self.running]
        for req in reversed(list(self.running)):
            self._preempt(req)
        return suspects

    def _pending(self, req: Request) -> int:
        """Tokens of `req` sampled by the step in flight, not yet in req.tokens (0 or 1)."""
        return int(self._inflight is not None and req in self._inflight.sampling)

    def _schedule(self) -> tuple[list[Request], list[int], list, list[str]]:
        cfg = self.config
        budget = cfg.max_tokens
        rows, counts, copies, preempted = [], [], [], []
        victims: set[Request] = set()
        for req in list(self.running):
            if req in victims or len(rows) == cfg.max_batch or budget == 0:
                continue  # preempted meanwhile, or no room left this step
            if self.solo is not None and req is not self.solo:
                continue  # isolating a request after a failed step: it runs alone
            pending = self._pending(req)
            if pending and len(req.output) + pending >= req.max_new_tokens:
                continue  # its token in flight is its last: it finishes when that step is processed
            n = min(len(req.tokens) + pending - req.num_computed, self.chunk, budget)
            while (blocks := self.manager.allocate_slots(req.request_id, n)) is None:
                if self._inflight is not None:
                    self._complete()  # pages of requests that ended under it come back; preempting is then safe
                    continue
                victim = self.running[-1]  # the newest request gives its pages back
                preempted.append(victim.request_id)
                victims.add(victim)
                self._preempt(victim)
                if victim is req:
                    break
            if blocks is None:
                continue
            rows.append(req)
            counts.append(n)
            copies += blocks.copies
            budget -= n
        reserved = sum(self._outstanding(req) for req in self.running)  # pages the running may still take
        if self.solo is not None and self.solo in self.waiting:
            self.waiting.remove(self.solo)
            self.waiting.appendleft(self.solo)
        while self.waiting and not preempted and len(rows) < cfg.max_batch and budget > 0:
            req = self.waiting[0]
            if self.solo is not None and (req is not self.solo or rows):
                break
            hits, hit_tokens = self.manager.get_computed_blocks(req.tokens)
            kept = [b for b in hits if not b.is_null]  # (behind a window the hits are the null block)
            taken = sum(1 for b in kept if b.ref_cnt == 0)  # cached blocks in the free queue: taken from it
            if self._pages_needed(req) - len(kept) + taken + reserved > self.manager.num_free_blocks:
                break  # wait until what it needs is free: admitted requests then finish without preemption
            n = min(len(req.tokens) - hit_tokens, self.chunk, budget)
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
            reserved += self._outstanding(req)
        return rows, counts, copies, preempted

    def _pages_needed(self, req: Request) -> int:
        """Pages `req` holds once it has its prompt and its reserved output tokens."""
        reserve = min(req.max_new_tokens, self.config.reserve_new_tokens)
        tokens = max(len(req.prompt) + reserve, len(req.tokens) + 1)
        return self.manager.pages_for(tokens, self.chunk)

    def _outstanding(self, req: Request) -> int:
        """Pages a running request may still take before its reservation is used up."""
        return max(0, self._pages_needed(req) - self.manager.num_held(req.request_id))

    # ------------------------------------------------------------------ one step

    def step(self) -> StepOutput:
        """Run one step and process its tokens. Async: launch the next step first (it stays in flight),
        and return the tokens of the step launched before."""
        start, cancelled = time.perf_counter(), self._drop_cancelled()
        preempted: list[str] = []
        if self._inflight is None and self._ready is None:  # nothing in flight: this call's own step
            first = self._prepare(preempted)
            if first is None:
                if self.waiting:
                    raise UserError("no request fits the paged KV pool", "give the batcher more pages")
                return StepOutput((), {}, tuple(cancelled), tuple(preempted), 0, pages_used=self.pages_used)
            self._launch(first, start)
        done = self._inflight or self._ready
        upcoming = self._prepare(preempted) if self.async_steps else None  # as if every row of `done` goes on
        self._complete()
        self._ready = None
        if upcoming is not None:
            self._launch(upcoming, done.tokens_at)
        return self._process(done, cancelled, preempted, start)

    def _prepare(self, preempted: list[str]) -> _Step | None:
        """Schedule a step and build its inputs (decode ids that the step in flight samples are holes);
        None when no row is scheduled. The rows' num_computed counts the step from here on."""
        rows, counts, copies, more = self._schedule()
        preempted += more
        if not rows:
            return None
        if getattr(self.model, "batch_invariant", False):
            # Single-token rows in a step of width 1, longer chunks in a step of the full chunk width:
            # each row's kernels (the attention's tiling depends on the step width) are then the same
            # whatever it is batched with.
            groups = [([i for i, n in enumerate(counts) if n == 1], 1),
                      ([i for i, n in enumerate(counts) if n > 1], self.chunk)]
        elif max(counts) > 1 and min(counts) == 1 and len(rows) * max(counts) > 2 * sum(counts):
            # Decode rows beside a prompt chunk would be padded to its width (8 rows x 128 columns for ~135
            # real tokens): they run as their own forward of width 1 instead.
            groups = [([i for i, n in enumerate(counts) if n == 1], 1),
                      ([i for i, n in enumerate(counts) if n > 1], max(counts))]
        else:
            groups = [(list(range(len(rows))), max(counts))]
        forwards = [self._forward([rows[i] for i in members], [counts[i] for i in members], width)
                    for members, width in groups if members]
        context = int(sum(req.num_computed for req in rows) + sum(counts))
        ends = []
        for req, n in zip(rows, counts):
            req.num_computed += n
            ends.append(req.num_computed)
        return _Step(rows, counts, ends, copies, forwards, max(w for m, w in groups if m), context)

    def _forward(self, rows: list[Request], counts: list[int], width: int) -> _Forward:
        """Inputs of one model forward over `rows` (counts[r] new tokens each, right-padded to `width`)."""
        ids = np.zeros((len(rows), width), np.int64)
        holes = []
        if width == 1 and min(counts) == 1:  # decode rows: one column, filled at once
            col = [req.tokens[req.num_computed] if req.num_computed < len(req.tokens) else -1 for req in rows]
            ids[:, 0] = col
            holes = [(r, 0, rows[r], rows[r].num_computed) for r, t in enumerate(col) if t < 0]
        else:
            for r, (req, n) in enumerate(zip(rows, counts)):
                known = min(n, len(req.tokens) - req.num_computed)
                ids[r, :known] = req.tokens[req.num_computed:req.num_computed + known]
                holes += [(r, c, req, req.num_computed + c) for c in range(known, n)]
        starts = [req.num_computed for req in rows]
        block_ids = self.manager.block_ids
        step = paged_step([block_ids(req.request_id) for req in rows], self.manager.block_size, starts, counts, width)
        picks, sampled = [], []
        for r, (req, n) in enumerate(zip(rows, counts)):
            pending = self._pending(req)
            if req.num_computed + n == len(req.tokens) + pending:  # the prompt is all computed: sample a token
                penalty = req.sampling.repetition_penalty != 1.0
                # history: the live token list, complete (holes' tokens appended) by the time the step runs
                picks.append(Pick(r, n - 1, req.sampling, req.seed, len(req.output) + pending,
                                  req.tokens if penalty else None))
                sampled.append(req)
        return _Forward(ids, step, picks, sampled, holes)

    def _launch(self, step: _Step, since: float) -> None:
        """Fill the step's holes (the previous step has run) and hand it to the pipeline."""
        for fwd in step.forwards:
            for r, c, req, pos in fwd.holes:
                assert pos < len(req.tokens), f"{req.request_id}: input token {pos} was never sampled"
                fwd.ids[r, c] = req.tokens[pos]
        step.since = since
        step.inflight = self.pipeline.launch(step.copies, [(f.ids, f.step, f.picks) for f in step.forwards])
        self._inflight = step

    def _complete(self) -> None:
        """Wait for the step in flight; append its tokens (dropped for requests that ended meanwhile)
        and give back the pages of requests that ended under it. It stays `_ready` until processed."""
        step, self._inflight = self._inflight, None
        if step is None:
            return
        try:
            tokens = step.inflight.result()
        finally:
            for rid in step.free_after:
                self.manager.free(rid)
        step.tokens_at = time.perf_counter()
        for fwd, got in zip(step.forwards, tokens):
            for req, token in zip(fwd.sampled, got):
                if req.finish_reason is None:
                    req.append(int(token))
                    step.accepted.append((req, int(token)))
        self._ready = step

    def _process(self, done: _Step, cancelled: list[str], preempted: list[str], start: float) -> StepOutput:
        """Prefix-cache the blocks `done` wrote; stop tokens, stop strings and max_new_tokens of its tokens."""
        for req, end in zip(done.rows, done.ends):
            if req.finish_reason is None and req.num_computed >= end and req.request_id in self.manager.seqs:
                self.manager.cache_blocks(req.request_id, req.tokens, end)
        now = time.perf_counter()
        new_tokens, finished = {}, list(cancelled)
        for req, token in done.accepted:
            if req.finish_reason is not None:
                continue
            if req.first_token_at is None:
                req.first_token_at = now
            new_tokens[req.request_id] = token
            stop = self._stop_string(req)
            if token in req.stop_token_ids:
                self._finish(req, "stop", token)
            elif stop is not None:
                self._finish(req, "stop", stop)
            elif len(req.output) >= req.max_new_tokens:
                self._finish(req, "length")
            else:
                continue
            finished.append(req.request_id)
        seconds = done.tokens_at - done.since if self.async_steps else time.perf_counter() - start
        return StepOutput(tuple(r.request_id for r in done.rows), new_tokens, tuple(finished), tuple(preempted),
                          int(sum(done.counts)), done.width, self.pages_used, seconds, done.context)

    def _stop_string(self, req: Request) -> str | None:
        """The first stop string in the output's text that the last token may have completed: only the
        tail is decoded (a token is at least one character, save special tokens: 8 spare)."""
        if not req.stop_strings:
            return None
        text = self.decode(req.output[-(max(len(s) for s in req.stop_strings) + 8):])
        hits = [(text.find(s), s) for s in req.stop_strings if s in text]
        return min(hits)[1] if hits else None
