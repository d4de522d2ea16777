"""The engine core: a child process that owns one BatcherLoop (scheduler, KV pages, engine steps) and
does nothing else; front ends (HTTP, chat templates, tokens to text and back) talk to it over one
socket each (serving/core_client.py is the other end; `serve --front-ends N` gives it N of them).

    front end k (CoreClient)                       this process
    spawn: python -m enginesmith.serving.engine_core FD0 [FD1 ...]   (one socket per front end)
    ── CoreSpec (on FD0 only) ────────────────────▶ open the engine (runtime.load), its PagedModel
    ◀─ ("ready", CoreInfo) on every FD | ("failed", kind, what, fix) on FD0
    ── ("add", id, prompt, max_new, stop ids, sampling) ─▶ loop.submit as "k:id"  (a receiver thread per FD)
    ── ("cancel", id, stopped) ──────────────────────────▶ loop.cancel("k:id")
    ── ("close",) ───────────────────────────────────────▶ FD0: loop.close, exit 0; FD k: front end k leaves
    ◀─ ("step", events, stats, ttft, itl) ─ one frame per turn of the loop thread that changed anything, to
                                           each front end: [(id, event), ...] of ITS requests only (serving/
                                           loop.py's events), the stats tuple (the whole core's figures, and
                                           the adds taken from that front end), every TTFT/ITL observation

Request ids are the front end's own; the core namespaces them by connection ("k:id"), so two front ends
never collide, and a request's events go only to the connection that added it. Frames are pickled tuples
(multiprocessing.connection: a length prefix, then the bytes); every FD was made by the process that
spawned the core (FD0 its own end; the others it hands to the front ends it spawns itself), so every peer
is ours and nothing untrusted is unpickled. Stop strings stay in the front ends (which decode the text
anyway): the core gets stop token ids only, and never decodes; a request a front end ends at a stop
string ("cancel" with stopped) counts as finished here, so every front end reports the same counts.

The loop thread never writes to a socket: it posts each front end's frame to that front end's sender
thread, and frames a slow front end has not taken yet merge into one. A send that has waited
CoreSpec.stall_timeout (30 s) means a front end that stopped reading (a wedged process): the core says so
in one line and shuts that socket down, which is then handled as that front end going away (below);
before this, one such front end filled its socket's buffer and stalled every other front end's streams.

Front end 0 going away (its socket at EOF, or its PID no longer our parent) makes the core cancel every
request, wait (bounded) until their pages are back, say so in one line on stderr, and exit: no orphan
holds the GPU. Front end k > 0 going away (EOF without "close") cancels its requests only, waits for
their pages, says so in one line, and the core serves on (front end 0, its supervisor, decides what
next). SIGINT is ignored (a Ctrl-C reaches the front ends, which drain, then close the core); SIGTERM
or SIGKILL by PID end the core, and every front end reports it.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

from enginesmith.core.errors import EngineError, UserError

FRONT_END_GONE_WAIT_S = 10.0   # the most the core waits for cancelled requests to give their pages back
STALL_TIMEOUT_S = 30.0         # a front end that has not taken a frame for this long is treated as gone
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
    stall_timeout: float = STALL_TIMEOUT_S  # seconds a send to a front end may wait before it is cut off


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


class Peer:
    """One front end's connection: its requests (loop ids "index:id"), the adds taken from it, and a sender
    thread. The loop thread only posts step frames (post: never blocks on the socket); what a slow front end
    has not taken yet merges into one frame. A send that has waited `stall_timeout` seconds (a front end
    that stopped reading) gets the connection shut down: its receiver sees EOF, as for a front end that died."""

    def __init__(self, index: int, conn: Connection):
        self.index, self.conn = index, conn
        self.send_lock = threading.Lock()
        self.live: set[str] = set()        # its ids submitted, not ended
        self.stopped: set[str] = set()     # its ids it ended at a stop string (they count as finished)
        self.taken = 0                     # adds given to the loop (the front end counts what it sent)
        self.last_stats: tuple | None = None
        self.gone = False                  # EOF, a failed send, a stall, or "close"
        self.sending_since: float | None = None  # monotonic start of the send in progress
        self._closed = False
        self._pending: tuple | None = None  # (events, stats, ttft, itl) posted, not taken by the sender yet
        self._busy = False                  # the sender holds a frame it has not finished sending
        self._wake = threading.Condition()
        self._sender: threading.Thread | None = None

    def send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.send_lock:
            if self._closed:
                raise OSError("the connection is closed")
            self.sending_since = time.monotonic()
            try:
                self.conn.send_bytes(data)
            finally:
                self.sending_since = None

    def start_sender(self) -> None:
        self._sender = threading.Thread(target=self._send_posted, daemon=True,
                                        name=f"enginesmith-core-sender-{self.index}")
        self._sender.start()

    def post(self, events: list, stats: tuple, ttft: list, itl: list) -> None:
        """Queue a step frame for the sender thread, merged with any it has not sent yet (the loop thread)."""
        with self._wake:
            if self._pending is None:
                self._pending = (list(events), stats, list(ttft), list(itl))
            else:  # its lists are our own copies: extended in place
                queued_events, _, queued_ttft, queued_itl = self._pending
                queued_events += events
                queued_ttft += ttft
                queued_itl += itl
                self._pending = (queued_events, stats, queued_ttft, queued_itl)
            self._wake.notify()

    def _send_posted(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closed and not self.gone:
                    self._wake.wait()
                if self._pending is None:
                    return
                frame, self._pending, self._busy = self._pending, None, True
            try:
                self.send(("step", *frame))
            except OSError:  # that front end is gone: its receiver sees the EOF and cancels its requests
                self.gone = True
                return
            finally:
                with self._wake:
                    self._busy = False

    def stalled(self, timeout: float) -> bool:
        since = self.sending_since
        return since is not None and time.monotonic() - since > timeout

    def cut_off(self) -> None:
        """Shut the socket down under a send that cannot finish: the send fails, the receiver sees EOF."""
        self.gone = True
        try:
            sock = socket.socket(fileno=os.dup(self.conn.fileno()))
        except OSError:
            return  # closed already
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()

    def flush_posted(self, deadline: float) -> None:
        """Wait (until `deadline`) for the sender to send what was posted: the core is about to exit."""
        while self._sender is not None and self._sender.is_alive() and time.monotonic() < deadline:
            with self._wake:
                if self._pending is None and not self._busy:
                    return
            time.sleep(0.005)

    def close(self) -> None:
        """Close our end (its reader sees EOF); under the send lock, so no thread writes to a closed, maybe
        reused, descriptor."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        with self.send_lock:
            self.conn.close()


class EngineCore:
    """The core's side of the sockets: requests in (a receiver thread per front end), events out (the loop
    thread posts them; a sender thread per front end sends them)."""

    def __init__(self, conns: list[Connection], parent_pid: int):
        self.peers = [Peer(k, conn) for k, conn in enumerate(conns)]
        self.stall_timeout = STALL_TIMEOUT_S   # CoreSpec's, once it arrived
        self.parent_pid = parent_pid
        self.loop = None
        self._outbox: list[tuple] = []         # (peer, id, event) of this turn; appended on the loop thread
        self._out_lock = threading.Lock()
        self._stop_adjust = 0                  # requests ended at a stop string: finished, not cancelled
        self.gone = threading.Event()          # front end 0 went away, or asked us to close
        self.closing = False                   # ... and which: True when it asked

    def sink(self, peer: Peer, request_id: str):
        def put(event: tuple) -> None:
            with self._out_lock:
                self._outbox.append((peer, request_id, event))
        return put

    def flush(self) -> None:
        """Send this turn's events and the stats to each front end, if anything changed (the loop thread)."""
        with self._out_lock:
            events, self._outbox = self._outbox, []
        mine: dict[int, list[tuple]] = {}
        for peer, rid, event in events:
            if event[0] != "token":
                peer.live.discard(rid)
                if rid in peer.stopped:
                    peer.stopped.discard(rid)
                    self._stop_adjust += event[:2] == ("done", "cancelled")
            mine.setdefault(peer.index, []).append((rid, event))
        ttft, itl = self.loop.take_observations()
        s = self.loop.stats()
        core = (s.running, s.waiting, s.pages_used, s.pages_total, s.requests_finished + self._stop_adjust,
                s.requests_cancelled - self._stop_adjust, s.prompt_tokens, s.generated_tokens)
        for peer in self.peers:
            stats = (*core, peer.taken)
            if peer.gone or (peer.index not in mine and not ttft and not itl and stats == peer.last_stats):
                continue
            peer.last_stats = stats
            peer.post(mine.get(peer.index, []), stats, ttft, itl)

    def receive(self, peer: Peer) -> None:
        """Apply one front end's messages until it closes or goes away (its receiver thread)."""
        said_close = False
        try:
            while True:
                message = pickle.loads(peer.conn.recv_bytes())
                if message[0] == "add":
                    self._add(peer, *message[1:])
                elif message[0] == "cancel":
                    if message[2]:
                        peer.stopped.add(message[1])
                    self.loop.cancel(f"{peer.index}:{message[1]}")
                elif message[0] == "close":
                    said_close = True
                    break
        except (EOFError, OSError):
            pass
        peer.gone = True
        if peer.index == 0:
            self.closing = said_close
            self.gone.set()
        else:
            peer.close()
            self.leave(peer, said_close)

    def _add(self, peer: Peer, rid: str, prompt: list[int], max_new: int, stop_ids: tuple, sampling) -> None:
        peer.live.add(rid)
        try:
            self.loop.submit(prompt, max_new, stop_ids, (), sampling, sink=self.sink(peer, rid),
                             request_id=f"{peer.index}:{rid}")
        except Exception as exc:  # the front end checked it already: a refusal here ends that request only
            self.sink(peer, rid)(("error", f"the engine core refused the request: {exc}"))
        peer.taken += 1

    def leave(self, peer: Peer, said_close: bool) -> None:
        """Front end k > 0 went away: cancel its requests and wait (bounded) until they ended; a line on
        stderr unless it said goodbye with nothing in flight."""
        live = self._cancel(peer)
        deadline = time.monotonic() + FRONT_END_GONE_WAIT_S
        while peer.live and time.monotonic() < deadline:
            time.sleep(0.02)
        if live or not said_close:
            how = "closed its connection" if said_close else "went away"
            print(f"enginesmith engine core (pid {os.getpid()}): front end {peer.index} {how}; cancelled "
                  f"{len(live)} requests, {len(peer.live)} still ending, KV pages in use: "
                  f"{self.loop.stats().pages_used}", file=sys.stderr, flush=True)

    def _cancel(self, peer: Peer) -> list[str]:
        live = list(peer.live)
        for rid in live:
            self.loop.cancel(f"{peer.index}:{rid}")
        return live

    def watch_parent(self) -> None:
        """Block until front end 0 is gone (or closed us): its socket's EOF, or a new parent PID. Meanwhile,
        cut off every front end that stopped reading (Peer.stalled)."""
        while not self.gone.wait(PARENT_POLL_S):
            if os.getppid() != self.parent_pid:
                self.gone.set()
            for peer in self.peers:
                if not peer.gone and peer.stalled(self.stall_timeout):
                    print(f"enginesmith engine core (pid {os.getpid()}): front end {peer.index} has not read its "
                          f"connection for {self.stall_timeout:g} s; closing it", file=sys.stderr, flush=True)
                    peer.cut_off()  # its receiver sees EOF: its requests are cancelled (front end 0: all)

    def free_and_exit(self) -> int:
        """Front end 0 is gone: cancel every request, wait for the pages, one line on stderr."""
        live = [rid for peer in self.peers for rid in self._cancel(peer)]
        deadline = time.monotonic() + FRONT_END_GONE_WAIT_S
        while (self.loop.in_flight or self.loop.stats().pages_used) and time.monotonic() < deadline:
            time.sleep(0.02)
        used = self.loop.stats().pages_used
        self.loop.close()
        print(f"enginesmith engine core (pid {os.getpid()}): the front end (pid {self.parent_pid}) is gone; "
              f"cancelled {len(live)} requests, KV pages in use: {used}; exiting", file=sys.stderr, flush=True)
        return 0 if used == 0 else 1


def main(argv: list[str]) -> int:
    """`python -m enginesmith.serving.engine_core FD0 [FD1 ...]`: serve the front ends on the sockets until
    front end 0 closes us (exit 0) or goes away (every request's pages freed, then exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    core = EngineCore([Connection(int(fd)) for fd in argv], os.getppid())
    first = core.peers[0]
    spec: CoreSpec = pickle.loads(first.conn.recv_bytes())
    core.stall_timeout = spec.stall_timeout
    try:
        core.loop, info = open_loop(spec, core.flush)
    except UserError as exc:
        kind = "engine" if isinstance(exc, EngineError) else "user"
        first.send(("failed", kind, exc.what, exc.fix))
        return 2
    except Exception as exc:  # a bug of ours, or the backend failing to open: one line for the front end
        first.send(("failed", "internal", f"{type(exc).__name__}: {str(exc)[:300]}", ""))
        return 1
    receivers = []
    for peer in core.peers:
        try:
            peer.send(("ready", info))
        except OSError:  # that front end is gone already; its receiver sees it
            pass
        peer.start_sender()
        receivers.append(threading.Thread(target=core.receive, args=(peer,), daemon=True,
                                          name=f"enginesmith-core-receiver-{peer.index}"))
        receivers[-1].start()
    core.watch_parent()
    if core.closing:  # front end 0 stops its front ends before it closes us: let the others' leave() end first
        deadline = time.monotonic() + FRONT_END_GONE_WAIT_S
        for thread in receivers[1:]:
            thread.join(max(0.0, deadline - time.monotonic()))
        core.loop.close()
        core.flush()
        deadline = time.monotonic() + FRONT_END_GONE_WAIT_S
        for peer in core.peers:
            peer.flush_posted(deadline)
        return 0
    return core.free_and_exit()


if __name__ == "__main__":  # run as the canonical module, so its classes pickle under their own names
    from enginesmith.serving import engine_core

    sys.exit(engine_core.main(sys.argv[1:]))
