"""One model step in flight while the scheduler prepares the next (async scheduling, as in vLLM v1).

Dimension legend: B rows of a forward, S its columns, P picks (tokens sampled by it).

The ContinuousBatcher hands a step (page copies + one or more forwards) to `StepPipeline.launch` and
gets an `InFlight` back at once; `InFlight.result()` waits for the sampled token ids. Meanwhile the
scheduler's host work for the next step runs beside the device:

    scheduler │ sched n+1 ─ wait n ─ fill n+1, launch ─ process n, return n │ sched n+2 ─ wait n+1 ─ ...
    device    │ ════ step n ══════╡ ═══════════ step n+1 ═══════════════════════════════╡ ═══ step n+2

How a step runs off the scheduler's thread, by what the model offers:
    model.launch_returns_early   `model.launch(ids, step, picks)` enqueues the step on the device and
                                 returns a handle whose result() waits (the CUDA engine: kernels and
                                 the token readback are queued; no worker thread, no GIL hand-offs)
    otherwise                    one worker thread calls copy_pages and run (ORT's CPU run and the fake
                                 model's sleep release the GIL, so the scheduler's Python runs beside)
    overlap off                  run on the caller's thread, done before launch returns (sync scheduling)

One step at a time: the batcher waits for step n before it launches n + 1 (n + 1's decode rows need
n's tokens as input ids), so the worker never has two jobs and the model is never entered twice.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, Sequence

Forward = tuple  # (ids [B, S] int64, PagedStep, picks): the arguments of PagedModel.run


class InFlight(Protocol):
    def result(self) -> list[list[int]]:
        """The token ids of each forward of the step (in launch order), once the step has run."""


class _Done:
    """A step that already ran (sync scheduling)."""

    def __init__(self, tokens: list[list[int]]):
        self.tokens = tokens

    def result(self) -> list[list[int]]:
        return self.tokens


class _Launched:
    """Handles of a step's forwards queued on the device (model.launch)."""

    def __init__(self, pending: list[Any]):
        self.pending = pending

    def result(self) -> list[list[int]]:
        return [p.result() for p in self.pending]


class StepPipeline:
    """Runs a PagedModel's steps for one ContinuousBatcher: off the caller's thread when `overlap`."""

    def __init__(self, model, overlap: bool):
        self.model = model
        self.overlap = overlap
        self.launches = overlap and bool(getattr(model, "launch_returns_early", False))
        self._worker: ThreadPoolExecutor | None = None

    def launch(self, copies: Sequence[tuple[int, int]], forwards: Sequence[Forward]) -> InFlight:
        """Copy-on-write page copies, then each forward (one tokens list per forward)."""
        if not self.overlap:
            return _Done(self._run(copies, forwards))
        if self.launches:  # the model queues the work itself: the copies are queued first, on its stream
            self.model.copy_pages(copies)
            return _Launched([self.model.launch(ids, step, picks) for ids, step, picks in forwards])
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="enginesmith-step")
        started = threading.Event()
        future = self._worker.submit(self._run, copies, forwards, started)
        # Hand the GIL to the worker until the step has started: else the scheduler's Python keeps it
        # for up to the interpreter's switch interval (5 ms) and the step waits behind the host work.
        started.wait()
        return future  # a Future is an InFlight: result() waits for the worker

    def _run(self, copies, forwards, started: threading.Event | None = None) -> list[list[int]]:
        if started is not None:
            started.set()
        self.model.copy_pages(copies)
        return [self.model.run(ids, step, picks) for ids, step, picks in forwards]

    def close(self) -> None:
        """End the worker thread (after the step it runs, if any)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None


__all__ = ["Forward", "InFlight", "StepPipeline"]
