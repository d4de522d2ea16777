"""Extra worker processes on one listening socket: the front door's (more cores to accept requests and relay
the replicas' bytes, `serve --door-workers`), and one server's front ends over one engine core
(`serve --front-ends`, serving/front_ends.py).

    front door process (worker 0: uvicorn + the supervision, serving/front_door.py)
        binds host:port once ─▶ one listening socket ─┬─▶ its own uvicorn
                                                      ├─▶ worker 1 (spawned; the same socket, its own uvicorn)
                                                      └─▶ worker k ...
        the kernel hands each new connection to one of the processes waiting in accept()

Why: relaying a streamed answer costs the front door ~50 µs of Python per token (httpx reads it, uvicorn
writes it); two GPUs make ~20k tokens/s, more than one core relays. Each worker routes with the shared
board (serving/door_board.py), so "the replica with the fewest in flight" is counted over all of them.

Workers are `multiprocessing` spawn processes (a fresh interpreter: no forked CUDA or thread state); the
socket and the spec (for the front door: the board) go to each as Process arguments, and what one worker alone
gets (a front end's connection to the engine core) as one more. They are stopped by the supervisor: `drain` (SIGTERM:
503 for new requests, exit once their relays are done), then `stop` (SIGTERM, then SIGKILL after the grace
time; every one joined). A worker whose supervisor is gone drains and exits by itself.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from enginesmith.serving.conn_guard import ConnectionLimits
from enginesmith.serving.door_board import DoorBoard


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its front-door app (picklable; the keys never reach a command line)."""

    urls: list[str]
    board: DoorBoard
    api_key: str | None
    internal_key: str
    log_level: str
    access_log: bool
    limits: ConnectionLimits = ConnectionLimits()


class DoorWorker:
    def __init__(self, index: int, process):
        self.index, self.process = index, process

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


class DoorWorkers:
    """Workers 1 .. count - 1 (worker 0 is the calling process)."""

    def __init__(self, workers: list[DoorWorker]):
        self.workers = workers

    @classmethod
    def start(cls, target: Callable, spec, sock: socket.socket, count: int, own: Sequence | None = None,
              label: str = "front-door worker") -> "DoorWorkers":
        """Spawn count - 1 processes running target(spec, sock, index, supervisor pid[, own[index - 1]]); each
        announces itself as `label` and its pid on stderr (so that whoever started the server can stop it by PID)."""
        ctx = multiprocessing.get_context("spawn")
        workers: list[DoorWorker] = []
        try:
            for index in range(1, count):
                mine = () if own is None else (own[index - 1],)
                process = ctx.Process(target=target, args=(spec, sock, index, os.getpid(), *mine),
                                      name=f"enginesmith-{label.replace(' ', '-')}-{index}", daemon=True)
                process.start()
                workers.append(DoorWorker(index, process))
                print(f"enginesmith serve: {label} {index} (pid {process.pid})", file=sys.stderr, flush=True)
        except BaseException:
            cls(workers).stop(0.0)
            raise
        return cls(workers)

    def __len__(self) -> int:
        return len(self.workers)

    def dead(self) -> list[DoorWorker]:
        """Workers that exited (any status) while they should be serving."""
        return [w for w in self.workers if w.exitcode is not None]

    def running(self) -> list[DoorWorker]:
        return [w for w in self.workers if w.exitcode is None]

    def drain(self) -> None:
        for w in self.workers:
            if w.exitcode is None:
                _signal(w.pid, signal.SIGTERM)

    def stop(self, grace: float) -> None:
        """Every worker stopped and joined: SIGTERM (a drain), SIGKILL for one still running after `grace` s."""
        self.drain()
        deadline = time.monotonic() + grace
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
            if w.exitcode is None:
                w.process.kill()
                w.process.join()


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended just now
        pass
