"""The front end's side of the engine core (serving/engine_core.py): CoreClient starts the core as a
child process (or, in a front end that `serve --front-ends N` spawned, attaches to the connection its
supervisor made for it) and stands in for a BatcherLoop (submit, cancel, events per request, stats,
drain, close), so the HTTP front door and Triton's model run over either unchanged.

    front end (this process)                                   engine core (child, by PID)
    submit ── checks (engine limits, max_waiting) ── ("add", …) ──▶ BatcherLoop.submit
    cancel ─────────────────────────────────── ("cancel", id, stopped) ─▶ BatcherLoop.cancel
    handle.put(event) ◀── reader thread ◀── ("step", events, stats, ttft, itl) ◀── after each turn
    close ──────────────────────────────────────── ("close",) ────▶ loop.close; exit 0 (else killed)

Admission happens here, without a round trip: UserError for a request the engine can never run
(the core's limits, sent once when it is ready), Draining once drain() or close() began, and
Overloaded unless W + N·u < max_waiting, where W is the core's waiting count in the last stats frame
(every front end's requests), u this front end's adds sent since that frame and not yet taken, and
N the number of front ends over the core. With N = 1 that is W + u < max_waiting: the queue never
exceeds max_waiting. With N front ends that read the same frame, each sends at most
ceil((max_waiting - W) / N) before the next one, so the queue is at most max_waiting + N - 1
(tests/serving/test_front_ends.py floods two clients at once to check it). A front end still reading
an older frame can add, at most, what it then saw as room.
Stop strings are the caller's (TextStream sees them in the text it decodes anyway): a caller that
ends a request at a stop string says cancel(id, stopped=True), and the core counts it as finished.

A core that dies (its socket at EOF without close()) is a failure: every request in flight ends
with ("error", ...) and `failure` says what happened in one line; the server exits on it.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Sequence

from enginesmith.core.errors import EngineError, UserError
from enginesmith.runtime.decoding.batching import ContinuousBatcher
from enginesmith.runtime.decoding.sampling import SamplingParams
from enginesmith.serving.engine_core import CoreInfo, CoreSpec
from enginesmith.serving.loop import Draining, Event, Handle, LoopStats, Overloaded, wait_drained

CLOSE_WAIT_S = 10.0


@dataclass(frozen=True)
class CoreModel:
    """The engine's limits, as the core reported them (what openai_api reads of loop.batcher.model)."""

    max_positions: int | None
    num_pages: int
    page_size: int
    max_batch: int


class RequestPages:
    """The core's KVCacheManager.pages_for, as its CoreInfo tells: whole pages, at most a window's."""

    def __init__(self, page_size: int, cap: int | None):
        self.page_size, self.cap = page_size, cap

    def pages_for(self, num_tokens: int, chunk: int) -> int:
        full = -(-num_tokens // self.page_size)
        return full if self.cap is None else min(full, self.cap)


class CoreLimits:
    """Stands in for loop.batcher: the engine's limits, and the batcher's own admission check run on them
    (one definition of what a request may ask; the core checks again, and a refusal there ends the request)."""

    check_request = ContinuousBatcher.check_request  # reads only .model, .chunk, .decode and .manager.pages_for

    def __init__(self, info: CoreInfo):
        self.model = CoreModel(info.max_positions, info.num_pages, info.page_size, info.max_batch)
        self.chunk = info.chunk
        self.manager = RequestPages(info.page_size, info.request_pages)
        self.decode = True  # stop strings are decoded by the front end: any may be given


class CoreClient:
    """A BatcherLoop's interface over an engine core process (start() makes one)."""

    def __init__(self, proc: subprocess.Popen | None, conn: Connection, info: CoreInfo, max_waiting: int,
                 front_ends: int = 1):
        self.proc, self.conn, self.info = proc, conn, info   # proc: None in a front end that attached
        self.batcher = CoreLimits(info)
        self.max_waiting, self.front_ends = max_waiting, front_ends
        self.spare: list[socket.socket] = []  # the other front ends' connections (start(front_ends=N)), to hand on
        self._handles: dict[str, Handle] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._core = (0, 0, 0, info.num_pages - 1, 0, 0, 0, 0, 0)  # the core's last stats tuple
        self._sent = 0
        self._ttft: list[float] = []
        self._itl: list[float] = []
        self._ids = itertools.count()
        self._accepting = True
        self._closing = False
        self._failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="enginesmith-core-reader", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.info.pid

    @classmethod
    def start(cls, spec: CoreSpec, max_waiting: int = 256, timeout: float = 600.0,
              front_ends: int = 1) -> "CoreClient":
        """Start the core on `spec`'s engine and wait until it is ready. UserError/EngineError as the
        core reports them (no paged KV, a bad engine directory), or when it dies or takes over `timeout` s.
        front_ends > 1: the core gets that many connections; `spare` holds the other front ends' ends
        (each to go to one process, which attach()es to it; close this process's copies once handed on)."""
        pairs = [socket.socketpair() for _ in range(front_ends)]
        fds = [theirs.fileno() for _, theirs in pairs]
        try:
            proc = subprocess.Popen([sys.executable, "-m", "enginesmith.serving.engine_core", *map(str, fds)],
                                    pass_fds=fds, stdin=subprocess.DEVNULL)
        except BaseException:
            for pair in pairs:
                pair[0].close()
            raise
        finally:
            for _, theirs in pairs:
                theirs.close()
        conn = Connection(pairs[0][0].detach())
        try:
            conn.send_bytes(pickle.dumps(spec))
            reply = _wait_ready(proc, conn, timeout)
        except BaseException:
            _stop(proc)
            conn.close()
            for ours, _ in pairs[1:]:
                ours.close()
            raise
        client = cls(proc, conn, reply, max_waiting, front_ends)
        client.spare = [ours for ours, _ in pairs[1:]]
        return client

    @classmethod
    def attach(cls, sock: socket.socket, max_waiting: int, front_ends: int, timeout: float = 60.0) -> "CoreClient":
        """The client of a front end that another process spawned, over the connection `sock` it was handed
        (one of that process's client.spare): the core's ("ready", CoreInfo) is its first frame."""
        conn = Connection(sock.detach())
        try:
            if not conn.poll(timeout):
                raise UserError(f"the engine core sent nothing in {timeout:g} s", "see the server's messages")
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            conn.close()
            raise UserError("the engine core closed the connection before it was ready",
                            "see the server's messages") from None
        assert reply[0] == "ready", reply[0]
        return cls(None, conn, reply[1], max_waiting, front_ends)

    # ------------------------------------------------------------------ BatcherLoop's interface
    def submit(self, prompt: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int] = (),
               stop_strings: Sequence[str] = (), sampling: SamplingParams | None = None,
               sink: Callable[[Event], None] | None = None) -> Handle:
        """Send a request to the core; its events go to `sink` (or the handle's queue). UserError,
        Overloaded and Draining as BatcherLoop.submit; stop strings are checked, not sent (see above)."""
        if self._failure is not None:
            raise Draining(self._failure)
        if not self._accepting:
            raise Draining("the server is shutting down")
        self.batcher.check_request(prompt, max_new_tokens, stop_strings)
        with self._lock:
            unacked = self._sent - self._core[8]
            if self._core[1] + self.front_ends * unacked >= self.max_waiting:  # the rule in the module doc
                raise Overloaded(self._core[1] + unacked)
            rid = f"c{next(self._ids)}"
            handle = self._handles[rid] = Handle(rid, len(prompt), sink)
            self._sent += 1
        try:
            self._send(("add", rid, [int(t) for t in prompt], max_new_tokens, tuple(stop_token_ids), sampling))
        except OSError:  # the core is gone; the reader reports it
            with self._lock:
                self._handles.pop(rid, None)
            raise Draining("the engine core stopped") from None
        return handle

    def cancel(self, request_id: str, stopped: bool = False) -> None:
        """End a request (a client went away, or `stopped`: the caller saw a stop string); its pages go back."""
        with self._lock:
            if request_id not in self._handles:
                return
        try:
            self._send(("cancel", request_id, stopped))
        except OSError:
            pass

    def stats(self) -> LoopStats:
        with self._lock:
            running, waiting, used, total, finished, cancelled, prompt, generated, taken = self._core
            return LoopStats(running, waiting + self._sent - taken, used, total, finished, cancelled, prompt,
                             generated, list(self._ttft), list(self._itl))

    def take_observations(self) -> tuple[list[float], list[float]]:
        """The TTFT and ITL observations since the last call (for histograms), cleared."""
        with self._lock:
            ttft, itl, self._ttft, self._itl = self._ttft, self._itl, [], []
            return ttft, itl

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._handles)

    @property
    def alive(self) -> bool:
        return self._failure is None and (self.proc is None or self.proc.poll() is None)

    @property
    def failure(self) -> str | None:
        """One line on why the core stopped without close(), or None."""
        return self._failure

    def drain(self, timeout: float | None = None) -> bool:
        """Take no new requests; wait until those in flight end. True if they all did."""
        self._accepting = False
        return wait_drained(lambda: self.in_flight, timeout)

    def close(self) -> None:
        """Stop the core (asked, then by PID after CLOSE_WAIT_S), or, attached, leave it (it cancels what is
        left of ours); requests in flight end with an error event."""
        self._accepting = False
        self._closing = True
        try:
            self._send(("close",))
        except OSError:
            pass
        for sock in self.spare:
            sock.close()
        if self.proc is not None:
            _stop(self.proc, CLOSE_WAIT_S)
        self._reader.join(timeout=5)  # the core closes its end: the process exited, or it let us go
        self.conn.close()
        self._end_all("the server stopped")

    # ------------------------------------------------------------------ the reader thread
    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self.conn.send_bytes(data)

    def _read(self) -> None:
        try:
            while True:
                message = pickle.loads(self.conn.recv_bytes())
                if message[0] == "step":
                    self._deliver(*message[1:])
        except (EOFError, OSError):
            pass
        if not self._closing:
            how = _how_it_ended(self.proc) if self.proc is not None else "closed its connection"
            self._failure = f"the engine core (pid {self.pid}) {how}"
            self._end_all(self._failure)

    def _deliver(self, events: list[tuple], stats: tuple, ttft: list[float], itl: list[float]) -> None:
        handles = []
        with self._lock:
            self._core = stats
            self._ttft += ttft
            self._itl += itl
            for rid, event in events:
                handle = self._handles.get(rid) if event[0] == "token" else self._handles.pop(rid, None)
                if handle is not None:
                    handles.append((handle, event))
        for handle, event in handles:
            handle.put(event)

    def _end_all(self, message: str) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.put(("error", message))


def _wait_ready(proc: subprocess.Popen, conn: Connection, timeout: float) -> CoreInfo:
    """The core's CoreInfo once it opened its engine; its refusal or its death as a UserError."""
    deadline = time.monotonic() + timeout
    while not conn.poll(0.1):
        if proc.poll() is not None:
            raise UserError(f"the engine core (pid {proc.pid}) {_how_it_ended(proc)} while opening the engine",
                            "see its message above; rerun with ENGINESMITH_DEBUG=1 for more")
        if time.monotonic() > deadline:
            raise UserError(f"the engine core (pid {proc.pid}) did not open the engine in {timeout:g} s",
                            "give serve --start-timeout more seconds")
    try:
        reply = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        proc.wait(timeout=5)
        raise UserError(f"the engine core (pid {proc.pid}) {_how_it_ended(proc)} while opening the engine",
                        "see its message above") from None
    if reply[0] == "failed":
        _, kind, what, fix = reply
        if kind == "internal":
            raise RuntimeError(what)
        raise (EngineError if kind == "engine" else UserError)(what, fix)
    return reply[1]


def _how_it_ended(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _stop(proc: subprocess.Popen, wait: float = 0.0) -> None:
    """Wait up to `wait` s for the core to exit, then kill it by its PID."""
    try:
        proc.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
