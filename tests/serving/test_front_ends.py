"""serving/front_ends.py and the engine core's several connections (`serve --front-ends N`), on the tiny
paged CPU engine.

  - three CoreClients over one core (one started it, two attached, each with its own ids "c0", "c1", ...)
    give the in-process loop's greedy tokens, and a random load with cancellations over all three leaves no
    page held; a flood through two clients at once stays within max_waiting + N - 1 waiting;
  - a connection that goes away mid-request: the core cancels its requests, their pages come back, the
    other connections serve on;
  - a connection that stops reading stalls no other one, and the core closes it after its stall timeout;
  - `serve --front-ends 2`: concurrent answers equal the oracle's and come from both front ends (the
    X-Enginesmith-Front-End header); /metrics of either gives the same engine figures; SIGTERM drains the
    streams of both and stops the core;
  - a front end killed by PID: the core frees its requests' pages (its line), the server exits 1 naming it;
  - the core killed by PID: the streams of every front end end with an error naming it, the server exits 1;
  - the refusals of --front-ends (thread core, replicas, out of range): one line, no traceback.
Every process a test starts is stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from test_engine_core import (CHUNK, MAX_BATCH, PAGES, collect, core_pid, in_process, kill,  # noqa: F401
                              random_load, running)
from test_serve import KEY, MODEL, PROMPTS, RUN_DIR, Server, engine, oracle, wait_for  # noqa: F401

from enginesmith.serving.core_client import CoreClient
from enginesmith.serving.engine_core import CoreSpec
from enginesmith.serving.loop import Overloaded

WORKER_PID = re.compile(r"front-end worker (\d+) \(pid (\d+)\)")
FRONT = "x-enginesmith-front-end"


def clients(engine, count: int, max_batch: int = MAX_BATCH, max_waiting: int = 64):  # noqa: F811
    """`count` CoreClients over one core: the first started it, the others attached to its spare connections."""
    first = CoreClient.start(CoreSpec(str(engine), "cpu", threads=1, max_batch=max_batch, num_pages=PAGES,
                                      chunk=CHUNK), max_waiting=max_waiting, timeout=60, front_ends=count)
    spare, first.spare = first.spare, []
    return [first] + [CoreClient.attach(sock, max_waiting, count) for sock in spare]


def close_all(cs: list[CoreClient]) -> None:
    for c in reversed(cs):  # the attached ones leave first; the first closes the core
        c.close()
    kill(cs[0].pid)


@pytest.fixture(scope="module")
def three(engine):  # noqa: F811
    cs = clients(engine, 3)
    try:
        yield cs
    finally:
        close_all(cs)


def settled(c: CoreClient):
    return wait_for(lambda: (s := c.stats()).running == 0 and s.waiting == 0 and s.pages_used == 0 and s, 30)


def test_three_connections_give_the_in_process_tokens(three, engine):  # noqa: F811
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 49152, int(n)).tolist() for n in rng.integers(1, 40, 12)]
    with ThreadPoolExecutor(6) as pool:  # request i through connection i % 3: their ids "c0", "c1", ... collide
        got = list(pool.map(lambda i: collect(three[i % 3].submit(prompts[i], 12)), range(12), timeout=120))
    assert all(end == ("done", "length", None) for _, end in got)
    assert [tokens for tokens, _ in got] == in_process(engine, prompts, 12)
    stats = [settled(c) for c in three]
    assert all(s and s.generated_tokens == stats[0].generated_tokens >= 144 for s in stats), stats


def test_random_load_over_three_connections_leaks_no_page(three):
    before = three[0].stats()
    seeds = np.random.default_rng(6).integers(0, 1 << 30, 45).tolist()
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda k: random_load(three[k], seeds[k::3], 0.3), range(3), timeout=300))
    ended = before.requests_finished + before.requests_cancelled + 45
    for c in three:
        s = wait_for(lambda: (s := c.stats()).requests_finished + s.requests_cancelled >= ended and s, 30)
        assert s and s.pages_used == 0 and s.running == 0 and s.waiting == 0 and c.in_flight == 0, s
        assert s.requests_finished + s.requests_cancelled == ended


def test_a_flood_through_two_connections_stays_within_the_bound(engine):  # noqa: F811
    """max_batch 1, max_waiting 4, N = 2: at most 4 + 2 - 1 = 5 wait (the bound of core_client's doc)."""
    cs = clients(engine, 2, max_batch=1, max_waiting=4)
    accepted: list[list] = [[], []]
    start = threading.Barrier(2)

    def flood(k: int) -> None:
        start.wait()
        for _ in range(20):
            try:
                accepted[k].append(cs[k].submit([1, 2, 3], 300))
            except Overloaded:
                pass

    try:
        threads = [threading.Thread(target=flood, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        total = len(accepted[0]) + len(accepted[1])
        assert 4 <= total <= 1 + 4 + 2 - 1, [len(a) for a in accepted]  # 1 running, at most 5 waiting
        assert accepted[0] and accepted[1]
        for k, handles in enumerate(accepted):
            for h in handles:
                cs[k].cancel(h.request_id)
        assert all(settled(c) for c in cs)
    finally:
        close_all(cs)


def test_a_connection_that_goes_away_gives_its_pages_back(engine):  # noqa: F811
    cs = clients(engine, 2)
    try:
        handles = [cs[1].submit([5, 6, 7, 8] * 5, 300) for _ in range(3)]
        wait_for(lambda: cs[0].stats().pages_used > 0)
        assert cs[0].stats().pages_used > 0
        sock = socket.socket(fileno=os.dup(cs[1].conn.fileno()))
        sock.shutdown(socket.SHUT_RDWR)  # as a process that died: no "close", its socket at EOF
        sock.close()
        assert wait_for(lambda: cs[1].failure, 10)
        assert all(h.events.get(timeout=10)[0] in ("token", "error") for h in handles)
        assert settled(cs[0])
        tokens, end = collect(cs[0].submit([1, 2, 3], 4))
        assert len(tokens) == 4 and end == ("done", "length", None)
    finally:
        close_all(cs)


def test_frames_a_front_end_has_not_taken_merge_into_one():
    from multiprocessing.connection import Connection

    from enginesmith.serving.engine_core import Peer

    ours, theirs = socket.socketpair()
    peer, reader = Peer(1, Connection(os.dup(ours.fileno()))), Connection(os.dup(theirs.fileno()))
    ours.close()
    theirs.close()
    try:
        peer.post([("a", ("token", 1))], (1,), [0.1], [])
        peer.post([("b", ("token", 2))], (2,), [], [0.01])
        peer.post([], (3,), [], [0.02])  # posted before the sender runs: one frame, the last stats
        peer.start_sender()
        assert reader.poll(10)
        assert pickle.loads(reader.recv_bytes()) == (
            "step", [("a", ("token", 1)), ("b", ("token", 2))], (3,), [0.1], [0.01, 0.02])
        peer.post([("a", ("done", "length", None))], (4,), [], [])
        assert reader.poll(10) and pickle.loads(reader.recv_bytes())[1:3] == ([("a", ("done", "length", None))], (4,))
        peer.flush_posted(time.monotonic() + 5)
        assert not reader.poll(0.2)  # nothing else was posted
    finally:
        peer.close()
        reader.close()


def test_a_connection_that_stops_reading_stalls_no_one_and_is_closed(engine, capfd):  # noqa: F811
    """Front end 1 connected but never reads (a wedged process). Its frames, one per step, filled its socket's
    buffer after ~1,000 steps and blocked the core's loop thread (24 requests of 300 tokens never ended).
    Now front end 0's requests end regardless, and once a send to front end 1 has waited `stall_timeout`
    (its buffer full: more rounds until then, as unsent frames merge), the core closes that connection."""
    first = CoreClient.start(CoreSpec(str(engine), "cpu", threads=1, max_batch=MAX_BATCH, num_pages=PAGES,
                                      chunk=CHUNK, stall_timeout=2.0), max_waiting=64, timeout=60, front_ends=2)
    silent = first.spare.pop()  # front end 1's end: never read
    said, line = "", "front end 1 has not read its connection for 2 s; closing it"
    try:
        deadline = time.monotonic() + 90
        while line not in said and time.monotonic() < deadline:
            handles = [first.submit([1 + i, 2, 3], 300) for i in range(24)]  # 6 rounds of MAX_BATCH 4
            got = [collect(h, timeout=30) for h in handles]
            assert all(len(tokens) == 300 and end == ("done", "length", None) for tokens, end in got)
            said += capfd.readouterr().err
        assert line in said, said
        silent.settimeout(30)
        while silent.recv(1 << 20):  # what was sent before the core gave up, then EOF: closed
            pass
        assert settled(first)
    finally:
        silent.close()
        close_all([first])


# ----------------------------------------------------------------------------- serve --front-ends N

def workers(server: Server, count: int) -> dict[int, int]:
    """{index: pid} of the spawned front ends, as the server announced them."""
    found = wait_for(lambda: len(m := dict(WORKER_PID.findall(server.err.read_text()))) >= count and m, 10)
    return {int(k): int(v) for k, v in found.items()}


def stop_all(server: Server, pids) -> None:
    server.stop()
    for pid in pids:
        wait_for(lambda: not running(pid), timeout=15)
        kill(pid)


def ask(server: Server, i: int, max_tokens: int) -> tuple[str, str, str]:
    """(text, finish reason, front end) of greedy PROMPTS[i], on a connection of its own."""
    r = server.http("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[i], "max_tokens": max_tokens,
                                                     "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["finish_reason"], r.headers[FRONT]


def open_stream(server: Server, i: int, max_tokens: int = 300):
    """A streamed request on a connection of its own that runs to max_tokens (ignore_eos): (its response, its
    lines to come, its front end) once a chunk arrived; close(response) closes its connection."""
    client = httpx.Client(timeout=60)
    response = client.send(client.build_request(
        "POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
        json={"model": MODEL, "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0, "stream": True,
              "ignore_eos": True}), stream=True)
    response.client = client  # held (and closed) with the response: a client collected early ends the stream
    assert response.status_code == 200, response.read()
    lines = response.iter_lines()
    assert next(line for line in lines if line.startswith("data: "))
    return response, lines, response.headers[FRONT]


def streams_on_both(server: Server) -> list[tuple]:
    """Streams opened 6 at a time (the kernel picks the process that accepts) until both front ends have one."""
    streams: list[tuple] = []
    for _ in range(5):
        with ThreadPoolExecutor(6) as pool:
            streams += pool.map(lambda i: open_stream(server, i), range(len(streams), len(streams) + 6), timeout=60)
        if {front for _, _, front in streams} == {"0", "1"}:
            break
    return streams


def close(response) -> None:
    response.close()
    response.client.close()


@contextlib.contextmanager
def two_front_ends(engine, tmp: Path):  # noqa: F811
    """`serve --front-ends 2` ready: (the server, the core's PID, front end 1's PID); all stopped by PID after."""
    s = Server(tmp, engine, "--front-ends", "2", env={"ENGINESMITH_API_KEY": KEY})
    pids: list[int] = []
    try:
        s.wait_ready()
        core, worker = core_pid(s), workers(s, 1)[1]
        pids += [core, worker]
        yield s, core, worker
    finally:
        stop_all(s, pids)


@pytest.fixture(scope="module")
def two(engine, tmp_path_factory):  # noqa: F811
    with two_front_ends(engine, tmp_path_factory.mktemp("fronts")) as (s, _, _):
        yield s
    assert "Traceback" not in s.err.read_text()


def test_two_front_ends_answer_as_the_oracle_and_both_serve(two, oracle):  # noqa: F811
    expected = [(e.text, e.finish_reason) for e in (oracle(p, 12)[1] for p in PROMPTS[:12])]
    served: set[str] = set()
    for _ in range(3):  # the kernel picks the process that accepts; rounds of 12 at once until both did
        with ThreadPoolExecutor(12) as pool:
            got = list(pool.map(lambda i: ask(two, i, 12), range(12), timeout=120))
        assert [g[:2] for g in got] == expected
        served |= {g[2] for g in got}
        if len(served) == 2:
            break
    assert served == {"0", "1"}


def test_every_front_end_reports_the_same_engine_figures(two):
    seen: dict[str, dict] = {}
    for _ in range(60):  # a scrape lands on either; fresh connections until both answered
        r = two.http("GET", "/metrics", key=None)
        seen.setdefault(r.headers[FRONT], r.text)
        if len(seen) == 2:
            break
    assert set(seen) == {"0", "1"}
    from test_serve import parse_prometheus

    figures = {k: parse_prometheus(text)[1] for k, text in seen.items()}
    for name in ("enginesmith_kv_pages_total", "enginesmith_kv_pages_used", "enginesmith_requests_total",
                 "enginesmith_generation_tokens_total", "enginesmith_prompt_tokens_total"):
        assert figures["0"][name] == figures["1"][name], name
    for k in ("0", "1"):
        assert f'{{front_end="{k}",reason="overloaded"}}' in figures[k]["enginesmith_requests_rejected_total"]


def test_sigterm_drains_the_streams_of_every_front_end(engine, tmp_path):  # noqa: F811
    with two_front_ends(engine, tmp_path) as (s, core, worker):
        with httpx.Client(timeout=60) as http:
            streams = streams_on_both(s)
            assert {front for _, _, front in streams} == {"0", "1"}, [f for _, _, f in streams]
            s.proc.send_signal(signal.SIGTERM)
            assert wait_for(lambda: http.get(s.url + "/health").status_code == 503, timeout=10)
            for response, lines, _ in streams:
                rest = [line for line in lines if line]
                assert rest[-1] == "data: [DONE]" and not any("error" in line for line in rest)
                close(response)
        assert s.proc.wait(timeout=60) == 0, s.err.read_text()
        assert wait_for(lambda: not any(running(pid) for pid in (core, worker)), timeout=15)
    assert "Traceback" not in s.err.read_text()


def test_a_killed_front_end_gives_its_pages_back_and_stops_the_server(engine, tmp_path):  # noqa: F811
    with two_front_ends(engine, tmp_path) as (s, core, worker):
        mine = []
        for _ in range(5):  # streams on front end 1 only (those on 0 closed at once: they are cancelled)
            with ThreadPoolExecutor(6) as pool:
                opened = list(pool.map(lambda i: open_stream(s, i, max_tokens=400), range(6), timeout=60))
            mine += [response for response, _, front in opened if front == "1"]
            for response in [response for response, _, front in opened if front != "1"]:
                close(response)
            if mine:
                break
        assert mine
        os.kill(worker, signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 1
        err = s.err.read_text()
        line = re.search(rf"engine core \(pid {core}\): front end 1 went away; cancelled (\d+) requests, 0 still "
                         r"ending, KV pages in use: 0", err)  # a stream of ours may have ended before the kill
        assert line and 1 <= int(line.group(1)) <= len(mine), err
        assert [line for line in err.splitlines() if line.startswith("enginesmith serve: front-end worker 1 (pid")
                and "exited" in line] == [f"enginesmith serve: front-end worker 1 (pid {worker}) exited with "
                                          "status -9"], err
        assert wait_for(lambda: not running(core), timeout=15)
        assert "Traceback" not in err
        for response in mine:
            close(response)


def test_a_killed_core_ends_the_streams_of_every_front_end(engine, tmp_path):  # noqa: F811
    with two_front_ends(engine, tmp_path) as (s, core, worker):
        streams = streams_on_both(s)
        assert {front for _, _, front in streams} == {"0", "1"}
        os.kill(core, signal.SIGKILL)
        for response, lines, _ in streams:
            rest = list(lines)
            assert any(f"the engine core (pid {core})" in line for line in rest), rest[-3:]
            close(response)
        assert s.proc.wait(timeout=30) == 1
        err = s.err.read_text()
        assert [line for line in err.splitlines() if "stopped:" in line] == [
            f"enginesmith serve: stopped: the engine core (pid {core}) was killed by SIGKILL; its requests ended "
            "with an error"], err
        assert wait_for(lambda: not running(worker), timeout=15)
        assert "Traceback" not in err


@pytest.mark.parametrize("flags, message", [
    (("--front-ends", "2", "--engine-core", "thread"), "--engine-core thread runs the engine inside"),
    (("--front-ends", "2", "--replicas", "2"), "with --devices or --replicas the front door has --door-workers"),
    (("--front-ends", "0"), "--front-ends 0 is out of range"),
    (("--front-ends", "33"), "--front-ends 33 is out of range"),
])
def test_front_ends_are_refused_where_they_make_no_sense(engine, flags, message):  # noqa: F811
    run = subprocess.run([sys.executable, "-m", "enginesmith.cli", "serve", "--engine", str(engine), "--port", "0",
                          *flags], capture_output=True, text=True, timeout=120, cwd=RUN_DIR)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], run.stderr
