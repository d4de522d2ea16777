"""The front door of `enginesmith serve --devices 0,1` (or `--replicas N`): one OpenAI API over several replicas.

    clients ──▶ front door (Starlette + uvicorn, --host/--port, the client's --api-key: 401 here), in
                --door-workers processes on one listening socket (serving/door_workers.py)
                  POST /v1/completions, /v1/chat/completions ── Router: the replica with the fewest requests
                      in flight over all the workers (the shared board, serving/door_board.py; ties: round
                      robin) ──▶ http://127.0.0.1:PORT_i (internal key) ──▶ replica i
                  ◀── its status, headers and body bytes, passed through as they come (SSE is not re-parsed)
                  GET /v1/models, /v1/models/{id}   the first live replica's answer
                  GET /health                       200 only if every replica answers 200 (503 while draining)
                  GET /metrics                      every replica's metrics with replica="i" added to each sample
                                                    (HELP/TYPE once), then the front door's own gauges

A client that disconnects (while its whole answer is made, or mid-stream) closes the request to its
replica, which cancels it and frees its pages. A replica's 4xx/5xx answers (429/503 with Retry-After)
pass through as they are. A replica whose process ended, or whose port refuses connections, is taken
out of the routing (503 for a request that found it so); FrontDoorServer, which watches the processes
(serving/replicas.py), then stops the whole server with exit status 1 so that it is restarted.

    SIGTERM / Ctrl-C ─▶ begin_drain (/health and new requests: 503; the other workers likewise) ─▶ SIGTERM to
        every replica (each drains) ─▶ wait until they exit (--drain-timeout + REPLICA_GRACE_S; a second signal
        is passed on, which cuts their requests off; then SIGKILL) ─▶ the last bytes reach the clients ─▶ the
        workers exit ─▶ uvicorn shuts down
    exit status: 0 if every replica exited 0; 1 if one cut requests off, was killed, or died while serving, or
    a front-door worker died
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from typing import Sequence

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from enginesmith.serving.metrics import PREFIX
from enginesmith.serving.openai_api import DRAIN_RETRY_AFTER_S, MAX_BODY_BYTES
from enginesmith.serving.http_guard import api_error, check_api_key, http_error, read_body, send_until_disconnect
from enginesmith.serving.conn_guard import (DRAIN_HEAD_GRACE_S, ConnectionLimits, begin_drain, heads_pending,
                                            install_accept_error_log, settle_heads)
from enginesmith.serving.http_server import AnnouncingServer
from enginesmith.serving.openai_protocol import ApiError, error_body
from enginesmith.serving.door_board import REASONS, DoorBoard
from enginesmith.serving.door_workers import DoorWorkers, WorkerSpec
from enginesmith.serving.replicas import ReplicaSet

log = logging.getLogger("enginesmith.serve")

REPLICA_GRACE_S = 10.0      # beyond --drain-timeout, what a replica may take to exit before SIGKILL
PROBE_TIMEOUT_S = 5.0       # /health and /metrics of one replica
KEEPALIVE_S = 2.0           # an idle connection to a replica is kept this long
PASSED_HEADERS = ("content-type", "content-length", "retry-after", "cache-control", "x-accel-buffering",
                  "www-authenticate")


class Router:
    """Which replica takes the next request: the fewest in flight among those up, counted over every
    front-door worker (the shared board); ties go round robin from where this worker left off."""

    def __init__(self, board: DoorBoard, worker: int = 0):
        self.board, self.worker = board, worker
        self._next = worker % board.replicas  # workers start their round robin at different replicas

    def choose(self) -> int | None:
        """The replica for the next request (None when none is up); does not count it (see acquire)."""
        board, n = self.board, self.board.replicas
        loads = {i: board.in_flight(i) for i in range(n) if board.is_up(i)}
        if not loads:
            return None
        least = min(loads.values())
        for k in range(n):
            i = (self._next + k) % n
            if loads.get(i) == least:
                self._next = (i + 1) % n
                return i
        raise AssertionError("unreachable: a live replica has the least requests in flight")

    def acquire(self) -> int | None:
        i = self.choose()
        if i is not None:
            self.board.add_in_flight(self.worker, i, 1)
        return i

    def release(self, i: int) -> None:
        self.board.add_in_flight(self.worker, i, -1)


def relabel_metrics(texts: Sequence[tuple[int, str]]) -> list[str]:
    """Prometheus text of several replicas as one exposition: each sample line gets `replica="i"` as its
    first label; a family's HELP and TYPE lines come once, then its samples of every replica together
    (the format wants each family in one group). `texts`: (replica index, its /metrics text)."""
    families: dict[str, tuple[list[str], list[str]]] = {}  # family -> (HELP/TYPE lines, samples), first seen first
    for index, text in texts:
        family: str | None = None
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    headers = families.setdefault(family, ([], []))[0]
                    if not any(h.startswith(f"# {parts[1]} ") for h in headers):
                        headers.append(line)
                continue  # other comments are dropped
            if not line.strip():
                continue
            cut = min((k for k in (line.find("{"), line.find(" ")) if k >= 0), default=len(line))
            name, rest = line[:cut], line[cut:]
            if family is None or not name.startswith(family):  # a sample of no declared family
                family = name
            label = f'replica="{index}"'
            rest = rest[2:] if rest.startswith("{}") else rest
            sample = f"{name}{{{label},{rest[1:]}" if rest.startswith("{") else f"{name}{{{label}}}{rest}"
            families.setdefault(family, ([], []))[1].append(sample)
    return [line for headers, samples in families.values() for line in (*headers, *samples)]


class FrontDoor:
    """The routes' shared state: the replicas, the router, the keys, the HTTP client, draining."""

    def __init__(self, urls: Sequence[str], board: DoorBoard, worker: int, api_key: str | None, internal_key: str,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.urls = list(urls)
        self.board, self.worker = board, worker
        self.router = Router(board, worker)
        self.api_key = api_key.encode() if api_key else None
        self.upstream_headers = {"authorization": f"Bearer {internal_key}"}
        self.max_body_bytes = max_body_bytes
        self.draining = False
        self.client: httpx.AsyncClient | None = None

    def begin_drain(self) -> None:
        self.draining = True

    def mark_down(self, i: int) -> None:
        self.board.mark_down(i)

    def reject(self, reason: str) -> None:
        self.board.reject(self.worker, reason)

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        # no pool limit (every stream holds a connection), no read timeout (a whole answer takes its time), and
        # idle connections dropped well before uvicorn's keep-alive timeout (5 s) could close one as it is reused
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=256, keepalive_expiry=KEEPALIVE_S)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=PROBE_TIMEOUT_S), limits=limits)
        try:
            yield
        finally:
            await self.client.aclose()

    # ------------------------------------------------------------------ routes

    async def generate(self, request: Request) -> Response:
        self._authorize(request)
        try:
            body = await self._body(request)
        except ClientDisconnect:
            return Response(status_code=499)
        if self.draining:
            self.reject("draining")
            raise ApiError(503, "the server is shutting down and takes no new requests", None, "draining",
                           retry_after=DRAIN_RETRY_AFTER_S)
        i = self.router.acquire()
        if i is None:
            self.reject("unavailable")
            raise ApiError(503, "no engine replica is running", None, "unavailable", retry_after=DRAIN_RETRY_AFTER_S)
        headers = {**self.upstream_headers, "content-type": request.headers.get("content-type", "application/json")}
        upstream = self.client.build_request("POST", self.urls[i] + request.url.path, content=body,
                                             headers=headers)
        return Proxied(self, i, upstream)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        live = [i for i in range(len(self.urls)) if self.board.is_up(i)]
        if not live:
            raise ApiError(503, "no engine replica is running", None, "unavailable", retry_after=DRAIN_RETRY_AFTER_S)
        try:
            r = await self.client.get(self.urls[live[0]] + request.url.path, headers=self.upstream_headers,
                                      timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            raise ApiError(503, "the engine replica did not answer", None, "unavailable",
                           retry_after=DRAIN_RETRY_AFTER_S) from None
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))

    async def health(self, request: Request) -> Response:
        answers = await asyncio.gather(*(self._probe(i, "/health") for i in range(len(self.urls))))
        states = [_health_state(r) for r in answers]
        replicas = [{"replica": i, "status": s} for i, s in enumerate(states)]
        if self.draining:
            return JSONResponse({"status": "draining", "replicas": replicas}, 503,
                                headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
        if all(s == "ok" for s in states):
            return JSONResponse({"status": "ok", "replicas": replicas})
        return JSONResponse({"status": "degraded", "replicas": replicas}, 503)

    async def metrics_text(self, request: Request) -> Response:
        answers = await asyncio.gather(*(self._probe(i, "/metrics") for i in range(len(self.urls))))
        texts = [(i, r.text) for i, r in enumerate(answers) if r is not None and r.status_code == 200]
        up = {i for i, _ in texts}
        p = PREFIX
        lines = relabel_metrics(texts)
        lines += [f"# HELP {p}replica_up Whether the replica answered this scrape (1) or not (0).",
                  f"# TYPE {p}replica_up gauge",
                  *(f'{p}replica_up{{replica="{i}"}} {int(i in up)}' for i in range(len(self.urls))),
                  f"# HELP {p}front_door_requests_in_flight Requests the front door (all its workers) has open at "
                  "each replica.",
                  f"# TYPE {p}front_door_requests_in_flight gauge",
                  *(f'{p}front_door_requests_in_flight{{replica="{i}"}} {self.board.in_flight(i)}'
                    for i in range(len(self.urls))),
                  f"# HELP {p}front_door_rejected_total Requests the front door refused itself, by reason.",
                  f"# TYPE {p}front_door_rejected_total counter",
                  *(f'{p}front_door_rejected_total{{reason="{k}"}} {self.board.rejected(k)}' for k in REASONS),
                  f"# HELP {p}front_door_workers Processes of the front door that accept and relay requests.",
                  f"# TYPE {p}front_door_workers gauge",
                  f"{p}front_door_workers {self.board.workers}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ pieces

    async def _probe(self, i: int, path: str) -> httpx.Response | None:
        if not self.board.is_up(i):
            return None
        try:
            return await self.client.get(self.urls[i] + path, timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return None

    def _authorize(self, request: Request) -> None:
        try:
            check_api_key(request, self.api_key)
        except ApiError:
            self.reject("unauthorized")
            raise

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.max_body_bytes)


def _health_state(answer: httpx.Response | None) -> str:
    """"ok", "down" (no answer, or not up), or what the replica said ("draining", "stopped")."""
    if answer is None:
        return "down"
    if answer.status_code == 200:
        return "ok"
    try:
        return str(answer.json()["status"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {answer.status_code}"


class Proxied(Response):
    """Replica `index`'s answer to `upstream`, passed through byte for byte as it comes. The client's
    disconnect is watched from the start (a whole answer sends nothing until it is complete): it cancels
    the upstream request, whose closed connection cancels the request at the replica."""

    def __init__(self, door: FrontDoor, index: int, upstream: httpx.Request):
        super().__init__()
        self.door, self.index, self.upstream = door, index, upstream

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send_until_disconnect(receive, lambda: self._relay(send))
        finally:
            self.door.router.release(self.index)

    async def _relay(self, send) -> None:
        try:
            response = await self.door.client.send(self.upstream, stream=True)
        except httpx.TransportError as exc:  # the replica is gone, or broke the connection before answering
            if isinstance(exc, httpx.ConnectError):  # nothing listens there any more: route around it
                log.warning("replica %d refused a connection (%s); no more requests go to it", self.index, exc)
                self.door.mark_down(self.index)
            self.door.reject("unavailable")
            refusal = JSONResponse(error_body(f"engine replica {self.index} did not answer; retry",
                                              "service_unavailable_error", None, "unavailable"), 503,
                                   headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
            await send({"type": "http.response.start", "status": 503, "headers": refusal.raw_headers})
            await send({"type": "http.response.body", "body": refusal.body})
            return
        try:
            headers = [(k.encode(), v.encode()) for k, v in response.headers.items() if k in PASSED_HEADERS]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            try:
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.TransportError as exc:  # the replica died mid-answer: the client sees a cut-off body
                log.warning("replica %d broke off an answer (%s)", self.index, exc)
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()


def make_front_door(urls: Sequence[str], board: DoorBoard, worker: int, api_key: str | None,
                    internal_key: str) -> Starlette:
    """The ASGI app of front-door worker `worker` over the replicas at `urls`; app.state.door is the FrontDoor."""
    door = FrontDoor(urls, board, worker, api_key, internal_key)
    routes = [Route("/v1/completions", door.generate, methods=["POST"]),
              Route("/v1/chat/completions", door.generate, methods=["POST"]),
              Route("/v1/models", door.models, methods=["GET"]),
              Route("/v1/models/{model:path}", door.models, methods=["GET"]),
              Route("/health", door.health, methods=["GET"]),
              Route("/metrics", door.metrics_text, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=door.lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error})
    app.state.door = door
    return app


class FrontDoorServer(AnnouncingServer):
    """Worker 0: uvicorn that also supervises the replicas and the other workers, and stops them with itself:
    on a signal, or when one of them dies (see the module doc)."""

    def __init__(self, config: uvicorn.Config, door: FrontDoor, replicas: ReplicaSet, workers: DoorWorkers,
                 drain_timeout: float, summary: str):
        super().__init__(config, summary)
        self.door, self.replicas, self.workers, self.drain_timeout = door, replicas, workers, drain_timeout
        self.signals = 0
        self.failed: list[str] = []     # why the exit status is 1
        self._stop_task: asyncio.Future | None = None

    def handle_exit(self, sig, frame) -> None:  # the signal handler uvicorn installs; no re-raise afterwards
        self.signals += 1
        self.door.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        self.announce()
        if self._stop_task is None:
            dead = [r for r in self.replicas if not r.alive]
            for r in dead:
                self.door.mark_down(r.index)
                self.failed.append(f"replica {r.index} ({r.label}, pid {r.pid}) exited with status {r.returncode} "
                                   "while serving")
            self.failed += [f"front-door worker {w.index} (pid {w.pid}) exited with status {w.exitcode}"
                            for w in self.workers.dead()]
            if self.failed or self.signals:
                self._stop_task = asyncio.ensure_future(self._stop())
        return await super().on_tick(counter)

    async def _stop(self) -> None:
        door, replicas = self.door, self.replicas
        door.begin_drain()
        begin_drain(self)  # idle connections and half-sent bodies: nothing to wait for
        self.workers.drain()  # they answer 503 to new requests and exit once their relays are done
        replicas.terminate()
        passed_on = self.signals
        deadline = time.monotonic() + self.drain_timeout + REPLICA_GRACE_S
        while replicas.alive and time.monotonic() < deadline:
            if self.signals > max(passed_on, 1):  # a second signal: the replicas cut their requests off
                passed_on = self.signals
                replicas.terminate()
            await asyncio.sleep(0.05)
        for r in replicas.alive:
            self.failed.append(f"replica {r.index} ({r.label}, pid {r.pid}) still ran "
                               f"{self.drain_timeout + REPLICA_GRACE_S:g} s after SIGTERM: killed")
        await asyncio.to_thread(replicas.kill, 0.0)
        for r in replicas:
            if r.returncode != 0 and not any(f"replica {r.index} " in f for f in self.failed):
                self.failed.append(f"replica {r.index} ({r.label}) exited with status {r.returncode}"
                                   + (" (it cut requests off)" if r.returncode == 1 else ""))
        deadline = time.monotonic() + 5.0  # the last bytes of the finished answers reach their clients
        while any(door.board.in_flight(i) for i in range(len(replicas))) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.workers.stop, 5.0)
        await settle_heads(self.server_state)
        self.should_exit = True


class WorkerServer(uvicorn.Server):
    """Worker 1, 2, ...: uvicorn on the shared socket; a signal (or its supervisor's end) drains it: it stops
    accepting (worker 0 takes the new connections), answers 503 to requests whose head was on its way, and
    exits once its own relays are done."""

    def __init__(self, config: uvicorn.Config, door: FrontDoor, supervisor: int):
        super().__init__(config)
        self.door, self.supervisor = door, supervisor
        self._drain_started: float | None = None

    async def startup(self, sockets=None) -> None:
        install_accept_error_log()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        self.door.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        if os.getppid() != self.supervisor:
            self.door.begin_drain()
        if self.door.draining and self._drain_started is None:
            self._drain_started = time.monotonic()
            begin_drain(self, stop_listening=True)  # worker 0 takes the new connections
        if self.door.draining and not self.door.board.in_flight_of(self.door.worker) and (
                not heads_pending(self.server_state) or time.monotonic() > self._drain_started + DRAIN_HEAD_GRACE_S):
            self.should_exit = True
        return await super().on_tick(counter)


def run_worker(spec: WorkerSpec, sock: socket.socket, index: int, supervisor: int) -> None:
    """The body of a spawned front-door worker (serving/door_workers.py)."""
    app = make_front_door(spec.urls, spec.board, index, spec.api_key, spec.internal_key)
    config = uvicorn.Config(app, log_level=spec.log_level, access_log=spec.access_log, lifespan="on",
                            timeout_graceful_shutdown=5, **spec.limits.uvicorn_options())
    WorkerServer(config, app.state.door, supervisor).run(sockets=[sock])


def serve_front_door(replicas: ReplicaSet, workers: int, api_key: str | None, internal_key: str, host: str,
                     port: int, drain_timeout: float, summary: str, log_level: str = "warning",
                     access_log: bool = False, limits: ConnectionLimits = ConnectionLimits()) -> list[str]:
    """Listen on host:port with `workers` front-door processes (this one and workers - 1 spawned ones, one
    listening socket) over the ready `replicas`; run until a signal or a death, and until the replicas and
    workers have stopped. Returns what made the exit status 1 (empty: 0). SystemExit when the address
    cannot be bound (uvicorn logs why)."""
    urls = [r.url for r in replicas]
    board = DoorBoard(workers, len(urls))
    app = make_front_door(urls, board, 0, api_key, internal_key)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5, **limits.uvicorn_options())
    sock = config.bind_socket()
    spec = WorkerSpec(urls, board, api_key, internal_key, log_level, access_log, limits)
    spawned = DoorWorkers.start(run_worker, spec, sock, workers)
    try:
        server = FrontDoorServer(config, app.state.door, replicas, spawned, drain_timeout, summary)
        server.run(sockets=[sock])
    finally:
        spawned.stop(0.0)
        sock.close()
    for line in server.failed:
        print(f"enginesmith serve: {line}", file=sys.stderr)
    return server.failed
