"""The front door's shared board: what its worker processes must agree on, in shared memory.

    worker w (one process each; w = 0 is the supervising process)
        in_flight[w, r]   requests worker w has open at replica r   (written only by worker w)
        rejected[w, k]    requests worker w refused itself, by reason k of REASONS (written only by worker w)
    up[r]                 replica r takes requests (1) or not (0): cleared by whoever finds it gone

Every cell has one writer (an aligned 8-byte store: never torn), so no lock: a reader sums the rows and may
see a value one request old, which routing tolerates. Router.choose reads the totals, so the least-busy
choice is global across the workers, not per worker.

The arrays are multiprocessing RawArrays: created by the supervisor, handed to each worker when it is
spawned (serving/door_workers.py), gone when the last process holding them exits.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.sharedctypes

REASONS = ("unauthorized", "draining", "unavailable")


class DoorBoard:
    """in_flight [workers, replicas], rejected [workers, len(REASONS)], up [replicas]; picklable into a
    spawned process (as a Process argument)."""

    def __init__(self, workers: int, replicas: int, ctx=None):
        ctx = ctx or multiprocessing.get_context("spawn")
        self.workers, self.replicas = workers, replicas
        self._in_flight = ctx.RawArray("q", workers * replicas)
        self._rejected = ctx.RawArray("q", workers * len(REASONS))
        self._up = ctx.RawArray("b", [1] * replicas)

    def in_flight(self, replica: int) -> int:
        """Requests open at `replica`, over every worker."""
        r, n = self.replicas, self._in_flight
        return sum(n[w * r + replica] for w in range(self.workers))

    def in_flight_of(self, worker: int) -> int:
        """Requests `worker` has open, at every replica."""
        r = self.replicas
        return sum(self._in_flight[worker * r: (worker + 1) * r])

    def add_in_flight(self, worker: int, replica: int, delta: int) -> None:
        cell = worker * self.replicas + replica
        assert self._in_flight[cell] + delta >= 0, f"replica {replica}: released more requests than it took"
        self._in_flight[cell] += delta

    def rejected(self, reason: str) -> int:
        k, n = REASONS.index(reason), len(REASONS)
        return sum(self._rejected[w * n + k] for w in range(self.workers))

    def reject(self, worker: int, reason: str) -> None:
        self._rejected[worker * len(REASONS) + REASONS.index(reason)] += 1

    def is_up(self, replica: int) -> bool:
        return bool(self._up[replica])

    def mark_down(self, replica: int) -> None:
        self._up[replica] = 0

    def set_up(self, replica: int, up: bool) -> None:
        self._up[replica] = int(up)
