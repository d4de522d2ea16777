"""The engine replicas behind `enginesmith serve --devices 0,1` (or `--replicas N`): one child process each.

    front door ── Popen (own session) ──▶ replica i: `python -m enginesmith.cli serve --engine DIR --host 127.0.0.1
                                          --port 0 ...`, env CUDA_VISIBLE_DEVICES=<its GPU>,
                                          ENGINESMITH_API_KEY=<the internal key>, ENGINESMITH_FRONT_DOOR_PID
               ◀── its stdout: the ready line "enginesmith serve: http://127.0.0.1:PORT (...)" ─▶ replica.url
               ◀── its stderr: copied to ours line by line, "[replica i] ..." (held until every replica is
                   ready); the last lines kept, so a replica that fails to start gives its own one-line
                   error (ENGINESMITH_DEBUG=1: its held lines too, with its traceback)

Processes, not threads: each engine's scheduler loop and its SSE event generation run on their own
GIL, with one CUDA context per process. Each child runs in a session of its own, so a Ctrl-C in the
terminal reaches only the front door, which stops the children itself (SIGTERM: each drains) and
kills by PID whatever is left on every way out (`ReplicaSet.kill`). A child whose front door dies
unseen (SIGKILL) notices its parent is gone and drains itself (cli/serve.py, ENGINESMITH_FRONT_DOOR_PID).

Start-up is parallel: every child starts at once; the first that exits before its ready line stops
the others and its error becomes one UserError; so does a child not ready within the timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass

from enginesmith.core.errors import EngineError, UserError

READY = re.compile(r"^enginesmith serve: (http://(?:\d{1,3}\.){3}\d{1,3}:\d+) ")
FRONT_DOOR_PID_ENV = "ENGINESMITH_FRONT_DOOR_PID"
TAIL_LINES = 20


@dataclass(frozen=True)
class ReplicaSpec:
    """What to start: `argv` with `env` (the whole environment of the child); `label` says where it runs."""

    label: str
    argv: list[str]
    env: dict[str, str]


class Replica:
    """One child `enginesmith serve` process; `url` once it printed its ready line."""

    def __init__(self, index: int, spec: ReplicaSpec):
        self.index, self.label = index, spec.label
        self.url: str | None = None
        self.ready = threading.Event()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._held: list[str] | None = []   # stderr lines before it is ready: shown once it is, or on a failure
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(spec.argv, env=spec.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, text=True, errors="replace",
                                     bufsize=1)
        self._readers = [threading.Thread(target=self._read, args=(stream, ready), daemon=True,
                                          name=f"replica-{index}-{name}")
                         for stream, ready, name in ((self.proc.stdout, True, "out"), (self.proc.stderr, False, "err"))]
        for t in self._readers:
            t.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def _read(self, stream, stdout: bool) -> None:
        """Copy the child's lines to our stderr; on stdout, the first ready line gives its URL."""
        for line in stream:
            line = line.rstrip("\n")
            if stdout and not self.ready.is_set():
                match = READY.match(line)
                if match:
                    self.url = match.group(1)
                    self.ready.set()
                    continue
            if not line.strip():
                continue
            self.tail.append(line)
            with self._lock:
                if self._held is not None:
                    self._held.append(line)
                else:
                    self._show([line])

    def _show(self, lines: list[str]) -> None:
        try:
            for line in lines:
                print(f"[replica {self.index}] {line}", file=sys.stderr, flush=True)
        except (OSError, ValueError):  # our stderr is gone: keep draining the pipe regardless
            pass

    def show_held(self) -> None:
        """From now on its stderr lines are shown as they come; those held so far first."""
        with self._lock:  # held, so no new line overtakes the held ones
            self._show(self._held or [])
            self._held = None

    def error_line(self) -> str:
        """The child's own `error: ...` line (without the prefix), else its last line, else its exit status."""
        lines = list(self.tail)
        for line in reversed(lines):
            if line.startswith("error: "):
                return line[len("error: "):]
        if lines:
            return lines[-1].strip()
        return f"it exited with status {self.returncode}"

    def signal(self, sig: int) -> None:
        if self.alive:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:  # it ended just now
                pass

    def finish_output(self, timeout: float = 2.0) -> None:
        """Wait (a little) for the reader threads to copy the last lines of an exited child."""
        for t in self._readers:
            t.join(timeout)


class ReplicaSet:
    """The children of one front door. `start` returns once every one is ready."""

    def __init__(self, replicas: list[Replica]):
        self.replicas = replicas

    def __len__(self) -> int:
        return len(self.replicas)

    def __getitem__(self, i: int) -> Replica:
        return self.replicas[i]

    def __iter__(self):
        return iter(self.replicas)

    @classmethod
    def start(cls, specs: list[ReplicaSpec], timeout: float) -> "ReplicaSet":
        """Start every spec at once and wait for each one's ready line (at most `timeout` seconds). On a
        failure, a timeout or an interrupt, every child is killed before the exception leaves."""
        replicas: list[Replica] = []
        try:
            for i, spec in enumerate(specs):
                replicas.append(Replica(i, spec))
            deadline = time.monotonic() + timeout
            while not all(r.ready.is_set() for r in replicas):
                for r in replicas:
                    if not r.ready.is_set() and not r.alive:
                        r.finish_output()
                        if os.environ.get("ENGINESMITH_DEBUG") == "1":
                            r.show_held()  # its traceback
                        what, _, fix = r.error_line().partition(" (fix: ")
                        error = EngineError if r.returncode == EngineError.exit_code else UserError
                        raise error(f"replica {r.index} ({r.label}) did not start: {what}",
                                        fix.removesuffix(")") or "see its lines above, prefixed [replica "
                                                                  f"{r.index}]")
                if time.monotonic() > deadline:
                    late = [r for r in replicas if not r.ready.is_set()]
                    raise UserError(f"{len(late)} replica(s) ({', '.join(r.label for r in late)}) not ready after "
                                    f"{timeout:g} s", "give --start-timeout more seconds, or see their lines above")
                time.sleep(0.05)
        except BaseException:
            cls(replicas).kill()
            raise
        for r in replicas:
            r.show_held()
        return cls(replicas)

    def terminate(self) -> None:
        """SIGTERM every live child: each drains its requests in flight, then exits."""
        for r in self.replicas:
            r.signal(signal.SIGTERM)

    def kill(self, grace: float = 5.0) -> None:
        """Stop every child that is still running: SIGTERM, then SIGKILL after `grace` seconds; reaped."""
        self.terminate()
        deadline = time.monotonic() + grace
        for r in self.replicas:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                r.signal(signal.SIGKILL)
                r.proc.wait()
        for r in self.replicas:
            r.finish_output(0.5)

    @property
    def alive(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive]


def cuda_visible(devices: list[int], environ: dict[str, str] | None = None) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each of `devices`, numbered as this process sees the GPUs: if it has a
    CUDA_VISIBLE_DEVICES of its own ("2,3"), device 0 is its first entry ("2")."""
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        return [str(d) for d in devices]
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    for d in devices:
        if d >= len(entries):
            raise UserError(f"--devices names GPU {d}, but CUDA_VISIBLE_DEVICES={visible} shows {len(entries)}",
                            f"give ids below {len(entries)} (they count the GPUs CUDA_VISIBLE_DEVICES shows)")
    return [entries[d] for d in devices]


def watch_front_door(environ: dict[str, str] | None = None, every_s: float = 0.5) -> None:
    """In a replica (ENGINESMITH_FRONT_DOOR_PID set): a thread that sends this process SIGTERM (a drain)
    once its front door is gone, so no replica outlives a front door that was killed unseen."""
    front_door = (os.environ if environ is None else environ).get(FRONT_DOOR_PID_ENV, "")
    if not front_door.isdigit():
        return

    def watch() -> None:
        while os.getppid() == int(front_door):
            time.sleep(every_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True, name="watch-front-door").start()
