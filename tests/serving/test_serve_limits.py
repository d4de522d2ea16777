"""Server limits against a hostile network (issue 28): `enginesmith serve` and its `--replicas` front door as
real processes on 127.0.0.1, attacked with raw sockets (tests/serving/hostile.py).

For each attack (idle connections, half a request head, a chunked body that never ends, a body shorter
than its Content-Length), N connections, more than --max-connections, are opened, then one real,
authenticated request must be answered (200) within 2 s, and the server must have closed every
hostile connection within its timeouts (plus slack). Also:
  - every connection busy with a request (bodies in progress) at the cap: a newcomer gets 503 with
    Retry-After at once, and 200 again once the body timeout has cut the busy ones;
  - a keep-alive connection that trickles one byte at a time is closed (the keep-alive and head timeouts);
  - ten concurrent 3.9 MB prompts are refused (400) without tokenizing them, and a normal request
    meanwhile is answered within 2 s;
  - SIGTERM with half-sent bodies: exit 0 at once, no traceback (no CancelledError);
  - SIGTERM while request heads are on their way (serve, the front door with two workers, two front ends):
    every one is answered, none reset, and the server exits 0;
  - failed accepts (out of file descriptors) are one log line, not a traceback each;
  - the limit flags are checked before any model is loaded.
stderr of every server must hold no traceback. Servers are stopped by PID; every wait is bounded;
N is 120 per attack (CI has 2 cores and the default open-files limit).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import hostile
from helpers.external import require_module
from test_serve import KEY, RUN_DIR, Server
from test_serve_replicas import stop_all

require_module("uvicorn", "pip install starlette uvicorn")

N = 120            # hostile connections per attack
CAP = 40           # --max-connections of the servers under attack
TIMEOUT = 1.0      # --header-timeout, --body-timeout and --keepalive-timeout of the servers under attack
LIMITS = ("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--keepalive-timeout", str(TIMEOUT),
          "--max-connections", str(CAP))


def _post(server: Server, body) -> "hostile.httpx.Response":
    return hostile.httpx.post(server.url + "/v1/completions", content=body, timeout=30,
                              headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})


def _port(server: Server) -> int:
    return int(server.url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def limited(paged_engine, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("limited"), paged_engine, *LIMITS, env={"ENGINESMITH_API_KEY": KEY})
    try:
        yield s.wait_ready()
    finally:
        s.stop()
    assert "Traceback" not in s.err.read_text()


@pytest.fixture(scope="module")
def limited_door(paged_engine, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("limited-door"), paged_engine, *LIMITS, "--replicas", "2",
               "--door-workers", "1", env={"ENGINESMITH_API_KEY": KEY})
    try:
        yield s.wait_ready(timeout=120)
    finally:
        stop_all(s)
    assert "Traceback" not in s.err.read_text()


def _attack_then_serve(server: Server, kind: str, key: str | None) -> None:
    """N hostile connections (with a key, bodies that the server reads: CAP - 2 of them, as more would be
    every connection busy with a request, which gets 503: the test below), then one real request."""
    n = CAP - 2 if key and kind in ("chunked", "short_body") else N
    socks = hostile.open_attack(kind, "127.0.0.1", _port(server), n, key=key)
    try:
        seconds, status = hostile.timed_request(server.url, KEY, timeout=10)
        assert status == 200 and seconds < 2.0, (kind, status, seconds)
        closed = hostile.closed_count(socks, 2 * TIMEOUT + 3)
        assert closed == n, f"{kind}: the server left {n - closed} of {n} hostile connections open"
    finally:
        hostile.close_all(socks)


ATTACKS = [(kind, None) for kind in hostile.ATTACKS] + [("chunked", KEY), ("short_body", KEY)]


@pytest.mark.parametrize("kind, key", ATTACKS)
def test_hostile_connections_cannot_lock_serve_out(limited, kind, key):
    _attack_then_serve(limited, kind, key)


@pytest.mark.parametrize("kind, key", ATTACKS)
def test_hostile_connections_cannot_lock_the_front_door_out(limited_door, kind, key):
    _attack_then_serve(limited_door, kind, key)


def test_busy_connections_at_the_cap_get_503_then_service_resumes(paged_engine, tmp_path):
    s = Server(tmp_path, paged_engine, "--max-connections", "8", "--body-timeout", "3",
               env={"ENGINESMITH_API_KEY": KEY}).wait_ready()
    try:
        busy = hostile.open_attack("short_body", "127.0.0.1", _port(s), 8, key=KEY)  # 8 requests reading a body
        try:
            time.sleep(0.3)
            r = _post(s, hostile.BODY)
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert r.json()["error"]["code"] == "too_many_connections"
            assert hostile.closed_count(busy, 6.0) == 8  # the body timeout cuts them
        finally:
            hostile.close_all(busy)
        seconds, status = hostile.timed_request(s.url, KEY, timeout=10)
        assert status == 200 and seconds < 2.0
    finally:
        s.stop()
    assert "Traceback" not in s.err.read_text()


def test_a_trickling_keep_alive_connection_is_closed(limited):
    with socket.create_connection(("127.0.0.1", _port(limited)), timeout=10) as sock:
        body = hostile.BODY
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        start, closed = time.monotonic(), False
        while time.monotonic() - start < 6 and not closed:  # a byte every 0.3 s would cancel uvicorn's own timer
            try:
                sock.sendall(b"G")
                time.sleep(0.3)
                closed = hostile.closed_count([sock], 0) == 1
            except OSError:
                closed = True
        assert closed and time.monotonic() - start < 2 * TIMEOUT + 2


def test_huge_prompts_are_refused_before_tokenizing_and_others_stay_fast(limited):
    huge = json.dumps({"model": "tiny:llama", "prompt": "lorem ipsum " * 325_000, "max_tokens": 2})  # 3.9 MB

    def send_huge(_):
        t0 = time.monotonic()
        r = _post(limited, huge)
        return r.status_code, r.json()["error"], time.monotonic() - t0

    with ThreadPoolExecutor(10) as pool:
        refusals = pool.map(send_huge, range(10))
        time.sleep(0.2)
        seconds, status = hostile.timed_request(limited.url, KEY, timeout=10)
        refusals = list(refusals)
    assert status == 200 and seconds < 2.0
    for code, error, took in refusals:
        assert code == 400 and "--max-prompt-bytes" in error["message"] and error["code"] == "context_length_exceeded"
        assert took < 5.0  # the upload itself; tokenizing 3.9 MB took ~6 s of CPU each


def test_sigterm_with_half_sent_bodies_exits_0_without_tracebacks(paged_engine, tmp_path):
    s = Server(tmp_path, paged_engine, env={"ENGINESMITH_API_KEY": KEY}).wait_ready()
    try:
        socks = hostile.open_attack("short_body", "127.0.0.1", _port(s), 5, key=KEY)
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=4) == 0
        hostile.close_all(socks)
    finally:
        s.stop()
    err = s.err.read_text()
    assert "Traceback" not in err and "CancelledError" not in err, err[-2000:]


def _head_answer(sock: socket.socket) -> bytes:
    """The status line and headers the server sends back (b"" if it closed the connection first)."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except OSError:  # reset
        pass
    return data


@pytest.mark.parametrize("flags", [(), ("--replicas", "2", "--door-workers", "2"), ("--front-ends", "2")],
                         ids=["serve", "front-door-2-workers", "front-ends-2"])
def test_sigterm_answers_the_requests_whose_head_was_on_its_way(paged_engine, tmp_path, flags):
    """A probe that connected just before SIGTERM gets an answer, not a reset (CI once saw a reset /health)."""
    s = Server(tmp_path, paged_engine, *flags).wait_ready(timeout=120)
    socks = []
    try:
        for _ in range(8):  # accepted by whichever process of the server
            socks.append(socket.create_connection(("127.0.0.1", _port(s)), timeout=10))
            socks[-1].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        time.sleep(0.3)
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the drain has begun: each process looks every 0.1 s
        for sock in socks:
            sock.sendall(b"\r\n")
        answers = [_head_answer(sock) for sock in socks]
        assert all(re.match(rb"HTTP/1.1 (200|503) ", a) for a in answers), answers
        assert s.proc.wait(timeout=30) == 0
    finally:
        hostile.close_all(socks)
        stop_all(s)
    err = s.err.read_text()
    assert "Traceback" not in err, err[-2000:]


ACCEPT_FLOOD = textwrap.dedent("""
    import asyncio, logging, resource
    from enginesmith.serving.conn_guard import install_accept_error_log
    logging.basicConfig(level=logging.WARNING)
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    async def main():
        install_accept_error_log()
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        print(server.sockets[0].getsockname()[1], flush=True)
        await asyncio.sleep(4)  # asyncio retries a failed accept every second

    asyncio.run(main())
""")


def test_failed_accepts_are_one_line_not_a_traceback_each(tmp_path):
    err = tmp_path / "stderr.txt"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-c", ACCEPT_FLOOD], cwd=RUN_DIR, stdout=subprocess.PIPE,
                                stderr=stderr, text=True)
    socks = []
    try:
        port = int(proc.stdout.readline())
        for _ in range(100):  # more connections than the server has file descriptors left
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        assert proc.wait(timeout=30) == 0
    finally:
        hostile.close_all(socks)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = err.read_text()
    lines = [line for line in text.splitlines() if "cannot accept" in line]
    assert "Traceback" not in text and len(lines) == 1 and "Too many open files" in lines[0], text[-2000:]


@pytest.mark.parametrize("flags, message", [
    (("--header-timeout", "0"), "--header-timeout 0.0 is out of range"),
    (("--body-timeout", "nan"), "--body-timeout nan is out of range"),
    (("--keepalive-timeout", "-1"), "--keepalive-timeout -1.0 is out of range"),
    (("--max-connections", "0"), "--max-connections 0 is out of range"),
    (("--max-prompt-bytes", "99999999"), "--max-prompt-bytes 99999999 is out of range"),
])
def test_bad_limit_flags_fail_in_one_line(flags, message):
    proc = subprocess.run([sys.executable, "-m", "enginesmith.cli", "serve", "--engine", "/nonexistent", *flags],
                          cwd=RUN_DIR, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
