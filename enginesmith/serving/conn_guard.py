"""Connection limits of every enginesmith HTTP server (`serve`, its front door and its workers): what keeps
idle and slow clients from locking the server out (anchors: nginx's client_header_timeout,
client_body_timeout and keepalive_timeout; uvicorn's --limit-concurrency).

uvicorn closes an idle keep-alive connection, but any byte cancels that timer, and it has no timeout on
a request's head or body: a client that trickles a header, never ends a chunked body, or sends less than
its Content-Length holds its connection (and a file descriptor) forever. So each connection is in one
phase, with a deadline:

    accepted ──▶ head (header_timeout: the whole request head) ──▶ body (body_timeout: the whole body)
       ▲                                                              │
       └── idle (keepalive_timeout; a first byte: head) ◀── response sent ◀── respond (no limit: answers
                                                                               and streams take their time)

A connection past its deadline is closed (the app sees a disconnect: its request ends with 499).
When the server drains, idle connections and those sending a body are closed; one still sending its head
gets at most DRAIN_HEAD_GRACE_S to finish it and is answered (503), and the server exits only once no
head is pending (or the grace has passed): a client that connected just before the drain gets an answer,
not a reset.
At most `max_connections` are open in one server process: a connection beyond that makes room by closing
the oldest one with no request in progress (idle or still sending its head); when every one has a
request in progress, the newcomer gets a 503 with Retry-After and is closed after a short linger.
A failed accept() (out of file descriptors) is one warning line at most every LOG_EVERY_S seconds,
with the count of those not shown, never a traceback per failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from uvicorn.protocols.http.auto import AutoHTTPProtocol

log = logging.getLogger("enginesmith.serve")

DRAIN_HEAD_GRACE_S = 1.0  # on a drain, what a connection still sending its request head has left to finish it
LINGER_S = 1.0          # a refused connection is read (and dropped) this long before it is closed
LOG_EVERY_S = 10.0      # at most one line per this many seconds about failed accepts
REFUSAL = json.dumps({"error": {"message": "too many open connections; retry shortly",
                                "type": "service_unavailable_error", "param": None,
                                "code": "too_many_connections"}}).encode()


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0     # seconds for a request's head (from the connection or its first byte)
    body_timeout: float = 30.0       # seconds for a request's whole body, from the end of its head
    keepalive_timeout: float = 5.0   # seconds an idle keep-alive connection stays open
    max_connections: int = 1000      # open connections of one server process

    def uvicorn_options(self) -> dict:
        """The uvicorn.Config keywords these limits set (the protocol class enforces the rest)."""
        return {"http": guarded_protocol(self), "timeout_keep_alive": self.keepalive_timeout}


class _Guard:
    """Mixed in before uvicorn's HTTP protocol class (h11 or httptools: both keep `cycle`, with its
    `more_body`, and call `on_response_complete`)."""

    limits: ConnectionLimits
    phase = "new"
    since = 0.0
    _deadline = float("inf")
    _timer: asyncio.TimerHandle | None = None
    _refused = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections and not _evict_one(self.connections, self):
            self._refuse()
            return
        self._enter("head", self.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # a refused connection's request is read and dropped until it is closed
        before = self.cycle
        if self.phase == "idle":
            self._enter("head", self.limits.header_timeout)
        super().data_received(data)
        self._follow(before)

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()  # a pipelined request may start here
        if not self.transport.is_closing():
            self._enter("idle", self.limits.keepalive_timeout)
            self._follow(before)

    def _follow(self, before) -> None:
        """The phase after uvicorn read some bytes: a new request's head is complete, or its body is."""
        cycle = self.cycle
        if cycle is not None and cycle is not before and not cycle.response_complete:
            if cycle.more_body:
                self._enter("body", self.limits.body_timeout)
            else:
                self._enter("respond", None)
        elif self.phase == "body" and cycle is not None and not cycle.more_body:
            self._enter("respond", None)

    def connection_lost(self, exc) -> None:
        self._cancel_timer()
        self.phase = "closed"
        super().connection_lost(exc)

    @property
    def in_progress(self) -> bool:
        """A request of this connection is being read or answered."""
        return self.phase in ("body", "respond")

    def drain(self) -> None:
        """A server that drains: close the connection if it is idle or sending a body (that request would
        be refused anyway); one still sending its head (a probe that connected just now) has at most
        DRAIN_HEAD_GRACE_S left to finish it, and is then answered (503: draining)."""
        if self.transport.is_closing() or self._refused:
            return
        if self.phase in ("idle", "body"):
            self.transport.close()
        elif self.phase == "head" and self._deadline - time.monotonic() > DRAIN_HEAD_GRACE_S:
            self._arm(time.monotonic() + DRAIN_HEAD_GRACE_S)

    def _enter(self, phase: str, timeout: float | None) -> None:
        self._cancel_timer()
        self.phase, self.since = phase, time.monotonic()
        if timeout is not None:
            self._arm(self.since + timeout)

    def _arm(self, deadline: float) -> None:
        """Close the connection at `deadline` unless it leaves its phase first."""
        self._cancel_timer()
        self._deadline = deadline
        self._timer = self.loop.call_at(self.loop.time() + deadline - time.monotonic(), self._expire, self.phase)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self, phase: str) -> None:
        self._timer = None
        if self.phase == phase and not self.transport.is_closing():
            self.transport.close()  # a request in its body phase then sees http.disconnect

    def _refuse(self) -> None:
        self._refused = True
        self.phase = "refused"
        head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(REFUSAL))
        self.transport.write(head + REFUSAL)
        self._timer = self.loop.call_later(LINGER_S, self.transport.close)


def _evict_one(connections, newcomer) -> bool:
    """Close the oldest connection without a request in progress; False if every one has one."""
    idle = [c for c in connections if c is not newcomer and not getattr(c, "in_progress", True)
            and not c.transport.is_closing()]
    if not idle:
        return False
    oldest = min(idle, key=lambda c: c.since)
    oldest.transport.close()
    return True


def guarded_protocol(limits: ConnectionLimits) -> type:
    """uvicorn's HTTP protocol class (httptools if installed, else h11) with these limits."""
    return type("GuardedHTTPProtocol", (_Guard, AutoHTTPProtocol), {"limits": limits})


def begin_drain(server, stop_listening: bool = False) -> None:
    """A uvicorn server that begins to drain: close its idle connections and those sending a body (a
    half-sent body would otherwise hold its task until shutdown cancels it); give those still sending
    their head DRAIN_HEAD_GRACE_S at most (see _Guard.drain). With stop_listening, a process that shares
    its listening socket with others first closes its own copy of it, so that the others accept."""
    if stop_listening:
        for listener in server.servers:
            listener.close()
    for conn in list(server.server_state.connections):
        if isinstance(conn, _Guard):
            conn.drain()


def heads_pending(server_state) -> bool:
    """A connection of this server is still sending its request head (its request is not answered yet:
    a server that exits now would reset it)."""
    return any(isinstance(c, _Guard) and c.phase == "head" and not c.transport.is_closing() and not c._refused
               for c in list(server_state.connections))


async def settle_heads(server_state, grace: float = DRAIN_HEAD_GRACE_S) -> None:
    """Before a drained server exits: wait (at most `grace` seconds) until no connection is still sending
    its request head, so that a client that connected during the drain gets its answer (503), not a reset."""
    deadline = time.monotonic() + grace
    while heads_pending(server_state) and time.monotonic() < deadline:
        await asyncio.sleep(0.02)


class AcceptErrorLog:
    """An event loop exception handler: failed accepts (EMFILE, ENFILE, ENOBUFS, ENOMEM) become one line per
    LOG_EVERY_S seconds at most; anything else goes to the loop's default handler."""

    def __init__(self):
        self.last = -LOG_EVERY_S
        self.unreported = 0

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict) -> None:
        message = str(context.get("message", ""))
        if "accept" not in message:
            loop.default_exception_handler(context)
            return
        self.unreported += 1
        now = time.monotonic()
        if now - self.last >= LOG_EVERY_S:
            exc = context.get("exception")
            log.warning("cannot accept a connection: %s (%d failed accept(s) since the last such line; lower "
                        "--max-connections or raise the open-files limit, ulimit -n)", exc or message,
                        self.unreported)
            self.last, self.unreported = now, 0


def install_accept_error_log() -> None:
    asyncio.get_running_loop().set_exception_handler(AcceptErrorLog())
