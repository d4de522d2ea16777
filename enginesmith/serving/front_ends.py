"""`serve --front-ends N`: N front-end processes (HTTP, SSE, chat templates, tokenization, detokenization,
stop strings) over ONE engine core process (serving/engine_core.py).

    supervisor = front end 0 (cli/serve.py, serve_front_ends below)
        CoreClient.start(spec, front_ends=N) ─▶ the engine core, one socket per front end
        binds host:port once ─▶ one listening socket ─┬─▶ its own uvicorn + OpenAI app, over socket 0
                                                      ├─▶ front end 1 (spawned, serving/door_workers.py): the
                                                      │   same listening socket, socket 1 to the core
                                                      └─▶ front end N-1 ...
        the kernel hands each new connection to one of the processes waiting in accept()

Why: at 64 streams on an H200 one front end's Python (SSE frames, detokenization) kept 0.87 of the engine's
offline tokens/s (docs/results.md, Session 16); the engine core's loop is one process whatever N is.
Every answer carries the header X-Enginesmith-Front-End: k (only with N > 1). /metrics of any front end
gives the core's engine figures and that front end's own HTTP counters (serving/metrics.py says which).
Admission: each front end bounds what it sends by the core's waiting count (serving/core_client.py states
the bound: at most max_waiting + N - 1 waiting).

Stopping and failures (as serving/front_door.py does for its workers):
  - SIGTERM / Ctrl-C to the supervisor: it and every front end (SIGTERM) drain: /health and new requests 503,
    open streams run to their end for at most --drain-timeout s; once every front end exited the supervisor
    closes the core. Requests cut off anywhere (a front end that exits 1) make the exit status 1.
  - a front end that dies: the core cancels its requests (their pages back, one line from the core); the
    supervisor drains the others, closes the core, and exits 1: "front-end worker k (pid P) exited with status S".
  - the core that dies: every front end's requests end with an error naming it, each front end stops, and the
    supervisor says "stopped: the engine core (pid P) ..." and exits 1.
  - the supervisor that dies: the core cancels everything and exits (serving/engine_core.py); the front ends
    see their core gone (and their parent changed) and exit.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import uvicorn

from enginesmith.serving.conn_guard import ConnectionLimits, begin_drain, settle_heads
from enginesmith.serving.core_client import CoreClient
from enginesmith.serving.door_workers import DoorWorkers
from enginesmith.serving.http_server import DrainingServer
from enginesmith.serving.openai_api import make_app

MAX_FRONT_ENDS = 32   # serve --front-ends N: see cli/serve.py's help for why
WORKER_GRACE_S = 5.0  # beyond the drain timeout, for a front end to send its last bytes and exit
HEADER = b"x-enginesmith-front-end"
LABEL = "front-end worker"


@dataclass(frozen=True)
class FrontEndSpec:
    """What a spawned front end needs to build its app (picklable; the API key never reaches a command line)."""

    engine: str
    model_name: str
    api_key: str | None
    max_prompt_bytes: int | None
    max_waiting: int
    front_ends: int
    drain_timeout: float
    log_level: str
    access_log: bool
    limits: ConnectionLimits = ConnectionLimits()
    started: object = None   # a shared counter (multiprocessing Value): front ends listening so far


def tokenizer_side(engine: str | Path):
    """The LoadedEngine a front end over an engine core needs: the manifest and the tokenizer, no engine."""
    from enginesmith.core import engine_dir  # deferred: the runtime and tokenizers, in the processes that serve
    from enginesmith.runtime.protocols import LoadedEngine  # deferred: with the line above
    from enginesmith.runtime.text.tokenizer import Tokenizer  # deferred: imports tokenizers

    path = Path(engine)
    return LoadedEngine(path, engine_dir.read_manifest(path), None, Tokenizer(path / "tokenizer"))


class TagAnswers:
    """ASGI middleware: every HTTP answer says which front end gave it (X-Enginesmith-Front-End: k)."""

    def __init__(self, app, index: int):
        self.app, self.value = app, str(index).encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (HEADER, self.value)]}
            await send(message)

        await self.app(scope, receive, tagged)


class FrontEndServer(DrainingServer):
    """Front end 1, 2, ...: serve's drain on a signal or when its supervisor is gone; no ready line (the
    supervisor prints the server's); a core that dies stops it (DrainingServer)."""

    stops_listening = True

    def __init__(self, config: uvicorn.Config, api, loop: CoreClient, drain_timeout: float, supervisor: int,
                 started, early_signal: list):
        super().__init__(config, api, loop, drain_timeout, "")
        self.supervisor, self.listening, self.early_signal = supervisor, started, early_signal

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        with self.listening.get_lock():
            self.listening.value += 1

    def announce(self) -> None:
        pass

    async def on_tick(self, counter: int) -> bool:
        if not self.signals and (self.early_signal or os.getppid() != self.supervisor):
            self.handle_exit(None, None)
        return await super().on_tick(counter)


def run_front_end(spec: FrontEndSpec, sock: socket.socket, index: int, supervisor: int,
                  core: socket.socket) -> None:
    """The body of spawned front end `index`: its app over the connection `core`, on the listening `sock`.
    Exit status 1 when its requests were cut off (a drain timeout, a second signal, the core's death)."""
    early: list = []  # a SIGTERM before uvicorn's handlers are in place drains it as soon as they are
    signal.signal(signal.SIGTERM, lambda sig, frame: early.append(sig))
    loop = CoreClient.attach(core, spec.max_waiting, spec.front_ends)
    try:
        app = make_app(tokenizer_side(spec.engine), loop, spec.model_name, spec.api_key,
                       max_prompt_bytes=spec.max_prompt_bytes, front_end=index)
        config = uvicorn.Config(TagAnswers(app, index), log_level=spec.log_level, access_log=spec.access_log,
                                lifespan="on", timeout_graceful_shutdown=5, **spec.limits.uvicorn_options())
        server = FrontEndServer(config, app.state.api, loop, spec.drain_timeout, supervisor, spec.started, early)
        server.run(sockets=[sock])
    finally:
        loop.close()  # leaves the core: it cancels whatever of ours is left
    if server.cut_off or loop.failure:
        sys.exit(1)


class SupervisorServer(DrainingServer):
    """Front end 0: serve's server that also watches the other front ends, drains them with itself, and closes
    the core only once they all exited (see the module doc)."""

    def __init__(self, config: uvicorn.Config, api, loop: CoreClient, workers: DoorWorkers, started,
                 drain_timeout: float, summary: str):
        super().__init__(config, api, loop, drain_timeout, summary)
        self.workers, self.listening = workers, started
        self.failed: list[str] = []     # why the exit status is 1, besides cut_off and the core's failure

    def announce(self) -> None:  # the ready line once every front end listens
        if self.listening.value >= len(self.workers):
            super().announce()

    async def on_tick(self, counter: int) -> bool:
        if not self.signals and not self.failed and self.batcher_loop.alive:
            dead = self.workers.dead()
            self.failed += [f"{LABEL} {w.index} (pid {w.pid}) exited with status {w.exitcode}" for w in dead]
            if dead:
                self.handle_exit(None, None)  # drain the others, then exit 1
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        loop, workers = self.batcher_loop, self.workers
        loop.drain(timeout=0)
        workers.drain()  # SIGTERM: each drains its own streams, for at most the same drain timeout
        begin_drain(self, self.stops_listening)
        deadline = time.monotonic() + self.drain_timeout
        passed_on = self.signals
        while time.monotonic() < deadline + WORKER_GRACE_S:
            if self.signals > max(passed_on, 1):  # a second signal: the front ends cut their requests off too
                passed_on = self.signals
                workers.drain()
            ours_done = not loop.in_flight or self.signals > 1 or time.monotonic() > deadline
            if ours_done and not workers.running():
                break
            await asyncio.sleep(0.05)
        if loop.in_flight:
            self.cut_off = "a second signal" if self.signals > 1 else f"the drain timeout ({self.drain_timeout:g} s)"
        await asyncio.to_thread(workers.stop, max(0.0, deadline + WORKER_GRACE_S - time.monotonic()))
        told = {line.split(" (pid")[0] for line in self.failed}
        self.failed += [f"{LABEL} {w.index} (pid {w.pid}) exited with status {w.exitcode}"
                        + (" (it cut requests off)" if w.exitcode == 1 else "")
                        for w in workers.workers if w.exitcode != 0 and f"{LABEL} {w.index}" not in told]
        await asyncio.to_thread(loop.close)  # the core: closed once no front end uses it
        await settle_heads(self.server_state)
        self.should_exit = True


def serve_front_ends(app, loop: CoreClient, spec: FrontEndSpec, host: str, port: int, summary: str,
                     ) -> tuple[str | None, list[str]]:
    """Listen on host:port with spec.front_ends processes over the ready core of `loop` (this one serving
    `app`, front end 0, and front_ends - 1 spawned ones, each on one of loop.spare); run until a signal, a
    death, and until every front end exited. Returns (what cut requests off here, or None; what else made
    the exit status 1). SystemExit when the address cannot be bound (uvicorn logs why)."""
    config = uvicorn.Config(TagAnswers(app, 0), host=host, port=port, log_level=spec.log_level,
                            access_log=spec.access_log, lifespan="on", timeout_graceful_shutdown=5,
                            **spec.limits.uvicorn_options())
    sock = config.bind_socket()
    started = multiprocessing.get_context("spawn").Value("i", 0)
    try:
        workers = DoorWorkers.start(run_front_end, replace(spec, started=started), sock, spec.front_ends,
                                    own=loop.spare, label=LABEL)
    except BaseException:
        sock.close()
        raise
    for spare in loop.spare:  # each is the spawned front end's now; a copy here would hide its death from the core
        spare.close()
    loop.spare = []
    try:
        server = SupervisorServer(config, app.state.api, loop, workers, started, spec.drain_timeout, summary)
        server.run(sockets=[sock])
    finally:
        workers.stop(WORKER_GRACE_S)
        sock.close()
    return server.cut_off, server.failed
