"""`bench serve --procs K`: the load of http_load.py split over K worker processes, for more server-sent
events per second than one Python process (one core, ~25-40k events/s) can read; then merged and
summarized as one run.

Legend: N requests, C concurrency, R arrival rate, K worker processes (at most min(C, N)),
w a worker (0..K-1), t0 the shared start.

    parent: N prompts (drawn once from --seed), open loop: due = arrival_times(N, R, seed), as one process
        │ deal round-robin: worker w gets requests w, w+K, w+2K, ... (with their due times) and
        │ C_w = C // K slots, one more for the first C % K workers (sum C_w = C)
        ▼ spawn K processes (multiprocessing, spawn context), one Pipe each
    worker w: C_w clients, its share of the warm-up ───────────────▶ "ready"
    parent:   all K ready ─▶ t0 = now + START_LEAD ─▶ "go t0" to each
    worker w: waits for t0, http_load._drive over its requests ────▶ "done" per request (the progress bar)
                                                                 ──▶ its Outcomes, or one "error" line
    parent:   Outcomes back in request order ─▶ http_load.report: the one summary (tok/s over last end - t0)

The clock: time.perf_counter is the system's monotonic clock (CLOCK_MONOTONIC on Linux), the same in
every process of one machine, so the workers' times and t0 compare directly.

Open loop: the workers keep the one-process schedule. Worker w sends request i at t0 + due[i] for its
i = w, w+K, ...: the merged arrivals are exactly those of --procs 1 with the same --seed (a Poisson process
of rate R), whatever K. Each worker's own arrivals are every K-th of them (rate R/K, not Poisson by
itself), and it keeps at most C_w in flight: an arrival that finds its worker's C_w slots busy waits,
even if another worker has a free one.

Closed loop: worker w runs C_w clients over its requests; a worker that runs out of requests leaves its
clients idle while the others finish (at most one request each of imbalance, as requests are dealt).

Processes: every worker is joined before a run returns. Ctrl-C (SIGINT to the process group) is the
parent's to handle: workers ignore it and the parent stops them (SIGTERM, then SIGKILL); a worker whose
parent dies exits on its own. A worker that fails sends one line, which the parent raises as a UserError;
one that dies without a word is named with its exit status.
"""

from __future__ import annotations

import asyncio
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.measure import http_load
from enginesmith.measure.http_load import Outcome, Prompt, Target

STREAMS_PER_PROC = 32     # --procs auto: one process per this many concurrent streams
START_LEAD = 0.05         # seconds between the parent's "go" and t0: every worker is waiting by then
STOP_WAIT = 5.0           # seconds a worker gets to end after SIGTERM before SIGKILL


@dataclass(frozen=True)
class Job:
    """One worker's share of a run."""

    target: Target
    prompts: tuple[Prompt, ...]
    concurrency: int              # C_w
    due: np.ndarray | None        # [N_w] seconds after t0 (open loop), or None (closed loop)
    timeout: float
    warmup: int


def procs_for(procs: int | str, concurrency: int, prompts: int) -> int:
    """K for one run: `procs` (an int, or "auto": min(CPUs, ceil(C / STREAMS_PER_PROC))), at most C and N."""
    if procs == "auto":
        procs = min(os.cpu_count() or 1, math.ceil(concurrency / STREAMS_PER_PROC))
    if not isinstance(procs, int) or procs < 1:
        raise UserError(f"invalid procs={procs!r}", "give a number of processes >= 1, or auto")
    return max(1, min(procs, concurrency, prompts))


def deal(target: Target, prompts: Sequence[Prompt], concurrency: int, due: np.ndarray | None, warmup: int,
         timeout: float, k: int) -> list[Job]:
    """The K jobs of a run: requests, due times and warm-up requests round-robin, C split evenly."""
    return [Job(target, tuple(prompts[w::k]), concurrency // k + (w < concurrency % k),
                None if due is None else due[w::k], timeout, warmup // k + (w < warmup % k)) for w in range(k)]


def run_load(target: Target, prompts: Sequence[Prompt], concurrency: int, rate: float | None = None, *,
             procs: int | str = 1, seed: int = 0, timeout: float = http_load.DEFAULT_TIMEOUT, tokenizer=None,
             warmup: int | None = None, progress: bool = False) -> dict:
    """http_load.run_load's run and figures, its load split over `procs` processes (module doc);
    the result's "procs" says how many ran it."""
    http_load.check_run(prompts, concurrency, rate, timeout)
    k = procs_for(procs, concurrency, len(prompts))
    if k == 1:
        return asyncio.run(http_load.run_load(target, prompts, concurrency, rate, seed=seed, timeout=timeout,
                                              tokenizer=tokenizer, warmup=warmup, progress=progress))
    warmup = min(concurrency, len(prompts)) if warmup is None else warmup
    due = None if rate is None else http_load.arrival_times(len(prompts), rate, seed)
    bar = http_load.progress_bar(len(prompts), concurrency, progress)
    try:
        warm, shares, t0 = run_workers(deal(target, prompts, concurrency, due, warmup, timeout, k), bar.update)
    finally:
        bar.close()
    outcomes: list[Outcome | None] = [None] * len(prompts)
    for w, share in enumerate(shares):
        outcomes[w::k] = share
    return http_load.report(concurrency, rate, prompts, warm, outcomes, t0, tokenizer, procs=k)  # type: ignore


def sweep(target: Target, prompts: Sequence[Prompt], concurrencies: Sequence[int], rate: float | None = None,
          **kwargs) -> list[dict]:
    """run_load at each concurrency on the same prompts (keyword arguments as run_load's)."""
    return [run_load(target, prompts, c, rate, **kwargs) for c in concurrencies]


# ----------------------------------------------------------------------------- the parent

def run_workers(jobs: Sequence[Job], on_done=None) -> tuple[list[Outcome], list[list[Outcome]], float]:
    """Run each job in a worker process from one shared start: (every warm-up outcome, each job's
    outcomes, t0). Every process started is joined before this returns or raises."""
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    try:
        for w, job in enumerate(jobs):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(theirs, job), name=f"bench-serve-load-{w}", daemon=True)
            proc.start()
            theirs.close()  # the worker holds the only write end: its exit reads as EOF here
            procs.append(proc)
            conns.append(mine)
        ready: set[int] = set()
        results: dict[int, tuple[list[Outcome], list[Outcome]]] = {}
        t0 = 0.0
        while len(results) < len(jobs):
            for conn in multiprocessing.connection.wait([c for w, c in enumerate(conns) if w not in results]):
                w = conns.index(conn)
                message = _receive(conn, procs[w], w, len(jobs))
                if message[0] == "done":
                    if on_done is not None:
                        on_done()
                elif message[0] == "ready":
                    ready.add(w)
                    if len(ready) == len(jobs):  # all warmed up: one start for all
                        t0 = time.perf_counter() + START_LEAD
                        for c in conns:
                            c.send(("go", t0))
                elif message[0] == "result":
                    results[w] = message[1], message[2]
                else:  # ("error", what, fix)
                    raise UserError(f"load worker {w + 1} of {len(jobs)} failed: {message[1]}",
                                    message[2] or "rerun with ENGINESMITH_DEBUG=1 in the environment for its "
                                                  "traceback, or with --procs 1")
        return [o for w in range(len(jobs)) for o in results[w][0]], [results[w][1] for w in range(len(jobs))], t0
    finally:
        _stop(procs)
        for conn in conns:
            conn.close()


def _receive(conn, proc, w: int, k: int) -> tuple:
    try:
        return conn.recv()
    except (EOFError, OSError):
        proc.join(STOP_WAIT)
        status = proc.exitcode
        how = f"was killed by signal {-status}" if status is not None and status < 0 else f"exited ({status})"
        raise UserError(f"load worker {w + 1} of {k} (pid {proc.pid}) {how} before its results were in",
                        "check the machine's memory and open-file limit (ulimit -n), or rerun with --procs 1") from None


def _stop(procs) -> None:
    """End every worker still running (SIGTERM, then SIGKILL) and join them all."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(STOP_WAIT)
        if proc.is_alive():
            proc.kill()
            proc.join()


# ----------------------------------------------------------------------------- a worker

def _worker(conn, job: Job) -> None:
    """One worker process: its job's load from the parent's t0; every outcome back, or one error line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the workers
    threading.Thread(target=_exit_with_parent, daemon=True).start()

    def start_at() -> float:
        conn.send(("ready",))
        message = conn.recv()
        return message[1]

    try:
        warm, outcomes, _ = asyncio.run(http_load.load(
            job.target, job.prompts, job.concurrency, job.due, timeout=job.timeout, warmup=job.warmup,
            on_done=lambda: conn.send(("done",)), start_at=start_at))
        conn.send(("result", warm, outcomes))
    except UserError as exc:
        conn.send(("error", exc.what, exc.fix))
    except Exception as exc:  # noqa: BLE001 - told to the parent in one line; the traceback on request
        if os.environ.get("ENGINESMITH_DEBUG") == "1":
            traceback.print_exc()
        first = str(exc).splitlines()[0] if str(exc) else ""
        conn.send(("error", f"{type(exc).__name__}: {first}", ""))
    finally:
        conn.close()


def _exit_with_parent() -> None:
    """A worker's watch: when its parent is gone (killed, say), the worker ends too."""
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(1)
