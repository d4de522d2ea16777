"""uvicorn, run and stopped the way `enginesmith serve` needs: a drain on the first signal.

    SIGTERM / Ctrl-C ─▶ api.begin_drain() (/health and new requests: 503) ─▶ loop.drain (nothing new taken)
        ─▶ wait while requests are in flight (at most drain_timeout s; a second signal: at once)
        ─▶ whatever is left is cut off (loop.close: its streams end with an error) ─▶ uvicorn shuts down
           (closes the listening socket, lets open responses send their last chunks, lifespan end)

The server keeps listening while it drains, so late clients get a clear 503 rather than a refused
connection. No signal is re-raised afterwards (uvicorn's default), so a drained server exits 0.
Once it listens, one line goes to stdout: "enginesmith serve: http://HOST:PORT (...)".
A loop whose `failure` is set (an engine core process that died) stops the server at once: its
requests already ended with an error; the caller reports the failure and exits 1.
Connections are bounded (serving/conn_guard.py): timeouts on a request's head, its body and keep-alive
idle, a cap on open connections (503 beyond it), and failed accepts logged one line at a time. A drain
first closes the connections whose request has not been read yet (a half-sent body ends as a disconnect).
"""

from __future__ import annotations

import asyncio
import time

import uvicorn

from enginesmith.serving.conn_guard import ConnectionLimits, begin_drain, install_accept_error_log, settle_heads


class AnnouncingServer(uvicorn.Server):
    """uvicorn that prints enginesmith serve's one ready line once it listens (call announce() from on_tick)."""

    def __init__(self, config: uvicorn.Config, summary: str):
        super().__init__(config)
        self.summary = summary
        self._announced = False

    async def startup(self, sockets=None) -> None:
        install_accept_error_log()  # before the listening socket exists: no traceback per failed accept
        await super().startup(sockets=sockets)

    def announce(self) -> None:
        if self.started and not self._announced:
            self._announced = True
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            host = f"[{host}]" if ":" in host else host
            print(f"enginesmith serve: http://{host}:{port} ({self.summary}); SIGTERM or Ctrl-C drains and stops",
                  flush=True)


class DrainingServer(AnnouncingServer):
    """serve's uvicorn server: a signal drains it (503 for new requests; those in flight finish, for at most
    the drain timeout), then it exits. One of several processes on a shared socket (stops_listening) stops
    accepting at once, so that the others take the new connections."""

    stops_listening = False

    def __init__(self, config: uvicorn.Config, api, loop, drain_timeout: float, summary: str):
        super().__init__(config, summary)
        self.api, self.batcher_loop, self.drain_timeout = api, loop, drain_timeout
        self.signals = 0
        self.cut_off: str | None = None     # why requests in flight were cut off, if they were
        self._drain_task: asyncio.Future | None = None

    def handle_exit(self, sig, frame) -> None:  # the signal handler uvicorn installs
        self.signals += 1
        self.api.begin_drain()

    async def on_tick(self, counter: int) -> bool:
        self.announce()
        if getattr(self.batcher_loop, "failure", None) and not self.should_exit:  # the engine core died: stop
            self.api.begin_drain()
            self.should_exit = True
        if self.signals and self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        loop = self.batcher_loop
        loop.drain(timeout=0)  # takes no more requests; returns at once
        begin_drain(self, self.stops_listening)
        deadline = time.monotonic() + self.drain_timeout
        while loop.in_flight and time.monotonic() < deadline and self.signals < 2:
            await asyncio.sleep(0.05)
        if loop.in_flight:
            self.cut_off = "a second signal" if self.signals > 1 else f"the drain timeout ({self.drain_timeout:g} s)"
            await asyncio.to_thread(loop.close)
        await settle_heads(self.server_state)
        self.should_exit = True


def serve(app, api, loop, host: str, port: int, drain_timeout: float, summary: str, log_level: str = "warning",
          access_log: bool = False, limits: ConnectionLimits = ConnectionLimits()) -> str | None:
    """Run `app` until a signal and its drain; None if every request in flight finished, else what cut
    them off ("a second signal", "the drain timeout (30 s)"). SystemExit when uvicorn cannot start
    (it logs why)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5, **limits.uvicorn_options())
    server = DrainingServer(config, api, loop, drain_timeout, summary)
    server.run()
    return server.cut_off
