"""The engine core: a child process that owns one BatcherLoop (scheduler, KV pages, engine steps) and
does nothing else; the front end (HTTP, chat templates, tokens to text and back) talks to it over
one socket (serving/core_client.py is the other end).

    front end (CoreClient)                         this process
    spawn: python -m enginesmith.serving.engine_core FD
    ── CoreSpec ──────────────────────────────────▶ open the engine (runtime.load), its PagedModel
    ◀─ ("ready", CoreInfo) | ("failed", kind, what, fix)
    ── ("add", id, prompt, max_new, stop ids, sampling) ─▶ loop.submit      (a receiver thread)
    ── ("cancel", id) ───────────────────────────────────▶ loop.cancel
    ── ("close",) ───────────────────────────────────────▶ loop.close, exit 0
    ◀─ ("step", events, stats, ttft, itl) ─ one frame per turn of the loop thread that changed anything:
                                           [(id, event), ...] (serving/loop.py's events), the stats tuple

Frames are pickled tuples (multiprocessing.connection: a length prefix, then the bytes); the front end
is this process's parent and its only peer, so nothing untrusted is unpickled. Stop strings stay in
the front end (which decodes the text anyway): the core gets stop token ids only, and never decodes.

The front end going away (its socket at EOF, or its PID no longer our parent) makes the core cancel
every request, wait (bounded) until their pages are back, say so in one line on stderr, and exit:
no orphan holds the GPU. SIGINT is ignored (a Ctrl-C reaches the front end, which drains, then
closes the core); SIGTERM or SIGKILL by PID end the core, and the front end reports it.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from enginesmith.core.errors import EngineError, UserError

FRONT_END_GONE_WAIT_S = 10.0   # the most the core waits for cancelled requests to give their pages back
PARENT_POLL_S = 0.5
CORE_MAX_WAITING = 1 << 30     # the front end bounds the queue (it answers 429); the core takes what it is sent
PLACEMENTS = ("auto", "thread", "process")  # serve --engine-core, Triton's ENGINE_CORE


def core_placement(choice: str, device: str) -> str:
    """Where the engine core runs, "thread" or "process", for `choice` (PLACEMENTS): auto is a process of
    its own on a GPU, where the engine's steps are fast enough for the front end's work under the same
    GIL to cost throughput; a thread of the server on the CPU, where the engine is the bottleneck and a
    second process only competes for the cores."""
    if choice not in PLACEMENTS:
        raise UserError(f"engine core placement {choice!r} is not one of {', '.join(PLACEMENTS)}",
                        f"give one of {', '.join(PLACEMENTS)}")
    if choice != "auto":
        return choice
    return "process" if device == "cuda" else "thread"


@dataclass(frozen=True)
class CoreSpec:
    """How the core opens its engine and scheduler (serve's flags, checked by the front end)."""

    engine: str
    device: str = "cpu"
    threads: int | None = None
    max_batch: int | None = None
    num_pages: int | None = None
    chunk: int = 64
    gpu_memory_utilization: float = 0.9
    cpu_max_batch: int = 16
    verify_hashes: bool = True       # sha256 every engine file before opening it


@dataclass(frozen=True)
class CoreInfo:
    """What the front end needs of the engine the core opened: limits for admission and for /v1/models."""

    pid: int
    max_positions: int | None
    num_pages: int
    page_size: int
    chunk: int
    max_batch: int
    request_pages: int | None   # the most pages one request holds whatever its length (a window), or None


def send(conn: Connection, lock: threading.Lock, message: tuple) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        conn.send_bytes(data)


def open_loop(spec: CoreSpec, after_iteration):
    """The BatcherLoop over the engine of `spec`, and its CoreInfo. UserError/EngineError as serve gives them."""
    from enginesmith.runtime.load import open_engine  # deferred: the runtime, once the spec arrived
    from enginesmith.serving.loop import BatcherLoop, serving_model  # deferred: imports the runtime

    loaded = open_engine(spec.engine, device=spec.device, threads=spec.threads, verify_hashes=spec.verify_hashes,
                         max_batch=spec.max_batch or 1,
                         num_pages=spec.num_pages, gpu_memory_utilization=spec.gpu_memory_utilization)
    model, scheduler = serving_model(loaded, spec.num_pages, spec.max_batch, spec.cpu_max_batch, spec.chunk)
    max_batch = scheduler.max_batch
    loop = BatcherLoop(model, scheduler, max_waiting=CORE_MAX_WAITING, after_iteration=after_iteration)
    info = CoreInfo(os.getpid(), model.max_positions or loaded.max_positions, model.num_pages, model.page_size,
                    loop.batcher.chunk, max_batch, _request_pages(loop.batcher))
    return loop, info


def _request_pages(batcher) -> int | None:
    """The most pages any request holds (a KV manager that frees pages behind a window), or None."""
    pages_for = getattr(batcher.manager, "pages_for", None)
    if pages_for is None:
        return None
    huge = 1 << 40
    cap = pages_for(huge, batcher.chunk)
    return None if cap >= huge // batcher.model.page_size else int(cap)


class EngineCore:
    """The core's side of the socket: requests in (a receiver thread), events out (the loop thread)."""

    def __init__(self, conn: Connection, parent_pid: int):
        self.conn, self.parent_pid = conn, parent_pid
        self.loop = None
        self._send_lock = threading.Lock()
        self._outbox: list[tuple] = []         # (id, event) of this turn; appended on the loop thread
        self._out_lock = threading.Lock()
        self._live: set[str] = set()           # ids submitted, not ended
        self._taken = 0                        # adds given to the loop (the front end counts what it sent)
        self._last_stats: tuple | None = None
        self.gone = threading.Event()          # the front end went away, or asked us to close
        self.closing = False                   # ... and which: True when it asked

    def sink(self, request_id: str):
        def put(event: tuple) -> None:
            with self._out_lock:
                self._outbox.append((request_id, event))
        return put

    def flush(self) -> None:
        """Send this turn's events and the stats, if anything changed (on the loop thread)."""
        with self._out_lock:
            events, self._outbox = self._outbox, []
        for rid, event in events:
            if event[0] != "token":
                self._live.discard(rid)
        ttft, itl = self.loop.take_observations()
        s = self.loop.stats()
        stats = (s.running, s.waiting, s.pages_used, s.pages_total, s.requests_finished, s.requests_cancelled,
                 s.prompt_tokens, s.generated_tokens, self._taken)
        if not events and not ttft and not itl and stats == self._last_stats:
            return
        self._last_stats = stats
        try:
            send(self.conn, self._send_lock, ("step", events, stats, ttft, itl))
        except OSError:  # the front end is gone: the receiver sees the EOF and ends the core
            self.gone.set()

    def receive(self) -> None:
        """Apply the front end's messages until it closes us or goes away (the receiver thread)."""
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                if message[0] == "add":
                    self._add(*message[1:])
                elif message[0] == "cancel":
                    self.loop.cancel(message[1])
                elif message[0] == "close":
                    self.closing = True
                    break
        except (EOFError, OSError):
            pass
        self.gone.set()

    def _add(self, rid: str, prompt: list[int], max_new: int, stop_ids: tuple, sampling) -> None:
        self._live.add(rid)
        try:
            self.loop.submit(prompt, max_new, stop_ids, (), sampling, sink=self.sink(rid), request_id=rid)
        except Exception as exc:  # the front end checked it already: a refusal here ends that request only
            self.sink(rid)(("error", f"the engine core refused the request: {exc}"))
        self._taken += 1

    def watch_parent(self) -> None:
        """Block until the front end is gone (or closed us): its socket's EOF, or a new parent PID."""
        while not self.gone.wait(PARENT_POLL_S):
            if os.getppid() != self.parent_pid:
                self.gone.set()

    def free_and_exit(self) -> int:
        """The front end is gone: cancel every request, wait for the pages, one line on stderr."""
        live = list(self._live)
        for rid in live:
            self.loop.cancel(rid)
        deadline = time.monotonic() + FRONT_END_GONE_WAIT_S
        while (self.loop.in_flight or self.loop.stats().pages_used) and time.monotonic() < deadline:
            time.sleep(0.02)
        used = self.loop.stats().pages_used
        self.loop.close()
        print(f"enginesmith engine core (pid {os.getpid()}): the front end (pid {self.parent_pid}) is gone; "
              f"cancelled {len(live)} requests, KV pages in use: {used}; exiting", file=sys.stderr, flush=True)
        return 0 if used == 0 else 1


def main(argv: list[str]) -> int:
    """`python -m enginesmith.serving.engine_core FD`: serve the front end on the socket FD until it
    closes us (exit 0) or goes away (its requests' pages freed, then exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(argv[0]))
    core = EngineCore(conn, os.getppid())
    spec: CoreSpec = pickle.loads(conn.recv_bytes())
    try:
        core.loop, info = open_loop(spec, core.flush)
    except UserError as exc:
        kind = "engine" if isinstance(exc, EngineError) else "user"
        send(conn, core._send_lock, ("failed", kind, exc.what, exc.fix))
        return 2
    except Exception as exc:  # a bug of ours, or the backend failing to open: one line for the front end
        send(conn, core._send_lock, ("failed", "internal", f"{type(exc).__name__}: {str(exc)[:300]}", ""))
        return 1
    send(conn, core._send_lock, ("ready", info))
    threading.Thread(target=core.receive, name="enginesmith-core-receiver", daemon=True).start()
    core.watch_parent()
    if core.closing:
        core.loop.close()
        core.flush()
        return 0
    return core.free_and_exit()


if __name__ == "__main__":  # run as the canonical module, so its classes pickle under their own names
    from enginesmith.serving import engine_core

    sys.exit(engine_core.main(sys.argv[1:]))
