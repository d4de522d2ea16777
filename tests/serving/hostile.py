"""Hostile clients for the server-limit tests (tests/serving/test_serve_limits.py), on raw sockets.

    open_attack(kind, host, port, n)   n connections that each hold the server in one way:
        idle        connect, send nothing
        slow_head   send half a request head, then nothing
        chunked     a complete head with Transfer-Encoding: chunked, one chunk, never the last one
        short_body  Content-Length: 1000, then 10 bytes
    closed_count(socks, timeout)       how many of them the server has closed (EOF or reset) within timeout
    timed_request(url, key)            (seconds, status) of one real completion request

Every socket is closed by `close_all`; nothing here waits without a bound.
"""

from __future__ import annotations

import select
import socket
import time

import httpx

ATTACKS = ("idle", "slow_head", "chunked", "short_body")
BODY = b'{"model": "tiny:llama", "prompt": "hello", "max_tokens": 2}'


def _head(extra: str) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"{extra}\r\n").encode()


def payload(kind: str, key: str | None = None) -> bytes:
    """The bytes an attack sends; with `key`, its head carries the API key (a request the server must read:
    without one the server answers 401 at once, and the connection has no request in progress)."""
    auth = f"authorization: Bearer {key}\r\n" if key else ""
    if kind == "idle":
        return b""
    if kind == "slow_head":
        return b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    if kind == "chunked":
        return _head(auth + "transfer-encoding: chunked\r\n") + b"10\r\n" + BODY[:16] + b"\r\n"
    if kind == "short_body":
        return _head(auth + "content-length: 1000\r\n") + BODY[:10]
    raise ValueError(kind)


def open_attack(kind: str, host: str, port: int, n: int, connect_timeout: float = 5.0,
                key: str | None = None) -> list[socket.socket]:
    """n sockets in the state `kind`; a connection the server refused at once still counts (it is open)."""
    data, socks = payload(kind, key), []
    try:
        for _ in range(n):
            s = socket.create_connection((host, port), timeout=connect_timeout)
            if data:
                s.sendall(data)
            socks.append(s)
    except BaseException:
        close_all(socks)
        raise
    return socks


def _is_closed(s: socket.socket) -> bool:
    """True once the server has closed `s` (EOF or a reset); data it sent (a 503) is read past."""
    try:
        while True:
            if not select.select([s], [], [], 0)[0]:
                return False
            if not s.recv(65536):
                return True
    except OSError:
        return True


def closed_count(socks: list[socket.socket], timeout: float) -> int:
    """How many of `socks` the server has closed, waiting up to `timeout` seconds for all of them."""
    deadline = time.monotonic() + timeout
    open_ = list(socks)
    while True:
        open_ = [s for s in open_ if not _is_closed(s)]
        if not open_ or time.monotonic() >= deadline:
            return len(socks) - len(open_)
        time.sleep(0.05)


def close_all(socks: list[socket.socket]) -> None:
    for s in socks:
        try:
            s.close()
        except OSError:
            pass


def timed_request(url: str, key: str | None = None, timeout: float = 60.0) -> tuple[float, int]:
    """(seconds, HTTP status) of one whole completion request on a fresh connection."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.monotonic()
    try:
        r = httpx.post(url + "/v1/completions", content=BODY, timeout=timeout,
                       headers={**headers, "content-type": "application/json"})
        status = r.status_code
    except httpx.HTTPError:
        status = 0
    return time.monotonic() - start, status
