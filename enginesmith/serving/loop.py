"""One scheduler loop for every front door (`enginesmith serve`, the Triton model): a thread steps the
ContinuousBatcher while requests are in flight; each request gets its own stream of events.

    front doors (any thread)                    the loop thread (owns the batcher)
    submit(prompt ids, ...) ─ checks ─ inbox ──▶ add_request (between steps)
    cancel(request id) ───────────── inbox ──▶ batcher.cancel (pages back at the next step)
    handle events ◀──────────── sink ────────── after each step: ("token", id) per new token,
                                                ("done", finish reason, stop) when it ends,
                                                ("error", message) if the engine failed

Admission: a request that can never fit (empty, too long for the engine or the pool) is refused in
`submit` (UserError, the caller's 400); beyond `max_waiting` requests not yet running, `submit`
raises Overloaded (the caller's 429/503 with Retry-After): no unbounded queue. `drain()` stops
taking requests and waits until those in flight end (SIGTERM); `close()` cancels what is left.

A step that raises (the engine failed) ends only the request at fault, when one can be found: every
request of the failed step is recomputed (batcher.recover), and if there were several, each runs alone
(batcher.solo) until it has made one more token; one that fails alone ends with ("error", message),
the others go on. A failure that no single request reproduces costs one solo round, then batching resumes.

The batcher is touched only by the loop thread (with async steps the engine's step runs beside it:
runtime/decoding/step_pipeline.py; a step is published once its tokens are back, and close() waits for the
step in flight). `stats()` is a consistent snapshot for /metrics:
running, waiting, KV pages used, tokens and requests so far, and the time-to-first-token and
inter-token-latency observations (histograms in serving/metrics.py).
"""

from __future__ import annotations

import collections
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import ContinuousBatcher, PagedModel, SchedulerConfig
from enginesmith.runtime.load import paged_model
from enginesmith.runtime.decoding.sampling import SamplingParams

Event = tuple  # ("token", id) | ("done", reason, stop) | ("error", message)



def wait_drained(in_flight: Callable[[], int], timeout: float | None) -> bool:
    """Wait until `in_flight()` is 0 (at most `timeout` s; None: no limit). True if it got there."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while in_flight() and (deadline is None or time.monotonic() < deadline):
        time.sleep(0.01)
    return in_flight() == 0


def serving_model(loaded, num_pages: int | None, max_batch: int | None, default_batch: int,
                  chunk: int) -> tuple[PagedModel, SchedulerConfig]:
    """The paged model of an opened engine and the scheduler settings `enginesmith serve` runs it with
    (in its own process or in the engine core's); an engine without paged KV is one line naming the fix."""
    try:
        model = paged_model(loaded, num_pages)
    except UserError:
        raise UserError(f"{loaded.path} has no paged KV cache; enginesmith serve runs every request through one "
                        "continuous batcher over KV pages",
                        "build the engine with `enginesmith build --kv paged` (CPU) or `enginesmith build --for-cuda "
                        "--kv paged` (GPU), or give --model to build one") from None
    max_batch = max_batch or getattr(model, "max_batch", None) or default_batch
    return model, SchedulerConfig(max_batch=max_batch, max_tokens=max(256, max_batch + chunk), chunk=chunk)

class Overloaded(Exception):
    """Too many requests waiting: retry after `retry_after` seconds."""

    def __init__(self, waiting: int, retry_after: int = 1):
        super().__init__(f"{waiting} requests are waiting already; try again later")
        self.retry_after = retry_after


class Draining(Exception):
    """The server is shutting down and takes no new requests."""


@dataclass
class Handle:
    """A submitted request: its id and where its events go (a thread-safe queue unless a sink is given)."""

    request_id: str
    prompt_tokens: int
    sink: Callable[[Event], None] | None = None
    events: "queue.Queue[Event]" = field(default_factory=queue.Queue)

    def put(self, event: Event) -> None:
        (self.sink or self.events.put)(event)


@dataclass
class LoopStats:
    running: int = 0
    waiting: int = 0
    pages_used: int = 0
    pages_total: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)   # observations since the last take_observations()
    itl_s: list[float] = field(default_factory=list)


class BatcherLoop:
    """The ContinuousBatcher behind a thread, shared by every front door of one engine."""

    def __init__(self, model: PagedModel, config: SchedulerConfig | None = None, max_waiting: int = 256,
                 enable_prefix_caching: bool = True, decode: Callable[[Sequence[int]], str] | None = None,
                 idle_wait: float = 0.05, after_iteration: Callable[[], None] | None = None):
        self.batcher = ContinuousBatcher(model, config, enable_prefix_caching, decode)
        self.max_waiting = max_waiting
        self.idle_wait = idle_wait
        self.after_iteration = after_iteration  # called on the loop thread after each turn (engine_core sends then)
        self._inbox: "queue.Queue[tuple]" = queue.Queue()
        self._handles: dict[str, Handle] = {}
        self._pending = 0                # submitted, not yet taken by the loop thread
        self._lock = threading.Lock()
        self._stats = LoopStats(pages_total=model.num_pages - 1)
        self._last_token: dict[str, float] = {}
        self._ids = itertools.count()
        self._accepting = True
        self._suspects: collections.deque[str] = collections.deque()  # to run alone after a failed step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="enginesmith-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
               stop_strings: Sequence[str] = (), sampling: SamplingParams | None = None,
               sink: Callable[[Event], None] | None = None, request_id: str | None = None) -> Handle:
        """Queue a request; its events go to `sink` (or the handle's queue). UserError for a request
        that cannot run, Overloaded when too many wait, Draining while shutting down. `request_id`:
        the caller's own id (unique among those in flight), else one is made."""
        if not self._accepting:
            raise Draining("the server is shutting down")
        self.batcher.check_request(prompt, max_new_tokens, stop_strings)
        with self._lock:
            waiting = self._stats.waiting + self._pending
            if waiting >= self.max_waiting:
                raise Overloaded(waiting)
            self._pending += 1
            rid = request_id or f"srv{next(self._ids)}"
        handle = Handle(rid, len(prompt), sink)
        self._inbox.put(("add", handle, (list(prompt), max_new_tokens, tuple(stop_token_ids), sampling,
                                         tuple(stop_strings), time.perf_counter())))
        return handle

    def cancel(self, request_id: str, stopped: bool = False) -> None:
        """End a request (a client went away); its pages go back at the next step. `stopped`: the
        caller saw a stop string (here the batcher has ended such a request itself already)."""
        self._inbox.put(("cancel", request_id))

    def stats(self) -> LoopStats:
        with self._lock:
            s = self._stats
            return LoopStats(s.running, s.waiting + self._pending, s.pages_used, s.pages_total, s.requests_finished,
                             s.requests_cancelled, s.prompt_tokens, s.generated_tokens, list(s.ttft_s), list(s.itl_s))

    def take_observations(self) -> tuple[list[float], list[float]]:
        """The TTFT and ITL observations since the last call (for histograms), cleared."""
        with self._lock:
            ttft, itl = self._stats.ttft_s, self._stats.itl_s
            self._stats.ttft_s, self._stats.itl_s = [], []
            return ttft, itl

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._stats.running + self._stats.waiting + self._pending

    @property
    def alive(self) -> bool:
        """The loop thread runs (False after close(), or had it died): what a health check reports."""
        return self._thread.is_alive()

    @property
    def failure(self) -> str | None:
        """Why the loop stopped without being closed, or None (a server exits when it is set)."""
        return None if self._stop.is_set() or self._thread.is_alive() else "the scheduler thread stopped"

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new requests; wait until those in flight end. True if they all did."""
        self._accepting = False
        return wait_drained(lambda: self.in_flight, timeout)

    def close(self) -> None:
        """Stop the loop thread; requests still in flight end with an error event."""
        self._accepting = False
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        for handle in list(self._handles.values()):
            handle.put(("error", "the server stopped"))
        self._handles.clear()

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._turn()
                if self.after_iteration is not None:
                    self.after_iteration()
        finally:
            self.batcher.close()  # with async steps: the step in flight ends, and the worker thread

    def _turn(self) -> None:
        """Take what the inbox holds (waiting for it when idle), then one step if anything runs."""
        self._take_inbox(block=not self.batcher.has_unfinished)
        if self._stop.is_set() or not self.batcher.has_unfinished:
            return
        try:
            out = self.batcher.step()
        except Exception as exc:  # an engine failure ends the request at fault, not the server
            self._isolate(f"the engine failed: {type(exc).__name__}: {(str(exc) or '-').splitlines()[0][:300]}")
            return
        self._publish(out)
        self._clear_solo(out)

    def _take_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _apply(self, item: tuple) -> None:
        if item[0] == "add":
            handle, (prompt, max_new, stop_ids, sampling, stop_strings, submitted) = item[1], item[2]
            with self._lock:
                self._pending -= 1
            try:
                self.batcher.add_request(prompt, max_new, stop_ids, sampling, handle.request_id, stop_strings)
            except UserError as exc:
                handle.put(("error", str(exc)))
                return
            self._handles[handle.request_id] = handle
            self._last_token[handle.request_id] = submitted
            with self._lock:
                self._stats.prompt_tokens += len(prompt)
        elif item[0] == "cancel" and item[1] in self._handles:
            self.batcher.cancel(item[1])

    def _publish(self, out) -> None:
        now = time.perf_counter()
        ttft, itl = [], []
        for rid, token in out.new_tokens.items():
            handle = self._handles.get(rid)
            if handle is None:
                continue
            req = self.batcher.request(rid)
            (ttft if len(req.output) == 1 else itl).append(now - self._last_token[rid])
            self._last_token[rid] = now
            handle.put(("token", token))
        cancelled = 0
        for rid in out.finished:
            req = self.batcher.finished.pop(rid)
            self._last_token.pop(rid, None)
            cancelled += req.finish_reason == "cancelled"
            handle = self._handles.pop(rid, None)
            if handle is not None:
                handle.put(("done", req.finish_reason, req.stop_reason))
        b = self.batcher
        with self._lock:
            s = self._stats
            s.running, s.waiting, s.pages_used = len(b.running), len(b.waiting), b.pages_used
            s.requests_finished += len(out.finished) - cancelled
            s.requests_cancelled += cancelled
            s.generated_tokens += len(out.new_tokens)
            s.ttft_s += ttft
            s.itl_s += itl

    def _isolate(self, message: str) -> None:
        """After a failed step: the request at fault ends with `message`; the others are recomputed."""
        culprit = self.batcher.solo
        suspects = self.batcher.recover()
        if culprit is not None or len(suspects) == 1:  # it failed alone
            self._fail_one(culprit.request_id if culprit is not None else suspects[0], message)
        elif suspects:
            self._suspects.extend(rid for rid in suspects if rid not in self._suspects)
        else:  # nothing was running (cannot happen: a step runs requests); end what waits, keep serving
            self._fail_all(message)
            return
        self._next_solo()

    def _clear_solo(self, out) -> None:
        """A request run alone that made a token (or ended) is not at fault: the next suspect runs alone."""
        solo = self.batcher.solo
        if (solo is None and self._suspects) or (solo is not None and solo.request_id in out.new_tokens):
            self._next_solo()

    def _next_solo(self) -> None:
        b = self.batcher
        b.solo = None
        while self._suspects and b.solo is None:
            rid = self._suspects.popleft()
            try:
                req = b.request(rid)
            except KeyError:
                continue
            if req.finish_reason is None and rid in self._handles:
                b.solo = req

    def _fail_one(self, rid: str, message: str) -> None:
        handle = self._handles.pop(rid, None)
        if handle is not None:
            handle.put(("error", message))
        self._last_token.pop(rid, None)
        self.batcher.cancel(rid)  # its finish at the next step is not published (no handle)

    def _fail_all(self, message: str) -> None:
        for rid, handle in list(self._handles.items()):
            handle.put(("error", message))
            self.batcher.cancel(rid)
        self._handles.clear()
        try:  # the cancellations free every page
            self.batcher.step()
        except Exception:
            pass
        self.batcher.finished.clear()
        b = self.batcher
        with self._lock:
            self._stats.running, self._stats.waiting, self._stats.pages_used = len(b.running), len(b.waiting), b.pages_used
