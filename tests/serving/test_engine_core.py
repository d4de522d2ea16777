"""serving/engine_core.py and core_client.py: the BatcherLoop in its own process, on the tiny paged CPU engine.

  - through CoreClient, greedy requests from several threads get the tokens an in-process BatcherLoop
    gives them; a random load with cancellations leaves no KV page held and nothing in flight;
  - `serve --engine-core process` answers as the oracle does (whole, streamed, chat, a stop string
    counted as finished), a disconnect gives its pages back, /metrics reads the core's counts, a flood
    gets 429, SIGTERM drains the streams and stops the core;
  - a core killed by PID stops the server with one line and exit status 1;
  - a front end killed by PID makes the core free its requests' pages and exit.
Every process a test starts is stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from test_serve import KEY, MODEL, PROMPTS, Server, concurrent_answers, engine, oracle, streamed, wait_for  # noqa: F401

from helpers.external import needs_cuda
from helpers.paged_engine import monkeypatch_module, paged_dir  # noqa: F401  (fixtures)

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import SchedulerConfig
from enginesmith.serving.core_client import CoreClient
from enginesmith.serving.engine_core import CoreSpec
from enginesmith.serving.loop import BatcherLoop

CORE = ("--engine-core", "process")
CORE_PID = re.compile(r"engine core pid (\d+)")
PAGES, MAX_BATCH, CHUNK = 96, 4, 8


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed front end's core is reaped by init, maybe later)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def kill(pid: int) -> None:
    if running(pid):
        os.kill(pid, signal.SIGKILL)


def core_pid(server: Server) -> int:
    return int(wait_for(lambda: CORE_PID.search(server.err.read_text()), timeout=10).group(1))


def collect(handle, timeout: float = 60.0) -> tuple[list[int], tuple]:
    tokens = []
    while True:
        event = handle.events.get(timeout=timeout)
        if event[0] != "token":
            return tokens, event
        tokens.append(event[1])


@pytest.fixture(scope="module")
def client(engine):  # noqa: F811
    c = CoreClient.start(CoreSpec(str(engine), "cpu", threads=1, max_batch=MAX_BATCH, num_pages=PAGES, chunk=CHUNK),
                         max_waiting=64, timeout=60)
    try:
        yield c
    finally:
        c.close()
        kill(c.pid)


def in_process(engine, prompts, max_new: int, device: str = "cpu") -> list[list[int]]:  # noqa: F811
    from enginesmith.runtime.load import open_engine, paged_model

    loaded = open_engine(engine, device=device, threads=1 if device == "cpu" else None)
    loop = BatcherLoop(paged_model(loaded, PAGES), SchedulerConfig(max_batch=MAX_BATCH, max_tokens=256, chunk=CHUNK))
    try:
        return [collect(h)[0] for h in [loop.submit(p, max_new) for p in prompts]]
    finally:
        loop.close()


def test_the_core_process_gives_the_tokens_of_the_in_process_loop(client, engine):  # noqa: F811
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 49152, int(n)).tolist() for n in rng.integers(1, 40, 10)]
    with ThreadPoolExecutor(5) as pool:
        got = list(pool.map(lambda p: collect(client.submit(p, 12)), prompts, timeout=120))
    assert all(end == ("done", "length", None) for _, end in got)
    assert [tokens for tokens, _ in got] == in_process(engine, prompts, 12)
    stats = wait_for(lambda: (s := client.stats()).running == 0 and s)
    assert stats.pages_used == 0 and stats.generated_tokens >= 120 and client.in_flight == 0
    ttft, itl = client.take_observations()
    assert len(ttft) >= 10 and len(itl) >= 110


def random_load(client: CoreClient, seeds: list[int], most_sleep: float) -> None:
    """One request per seed from 8 threads (prompts of 1..59 tokens, 1..39 new), half of them cancelled
    after up to `most_sleep` s (some as stopped); every one must end with a "done" event."""
    ends: list[tuple] = []

    def one(i: int) -> None:
        r = np.random.default_rng(i)
        handle = client.submit(r.integers(0, 49152, int(r.integers(1, 60))).tolist(), int(r.integers(1, 40)))
        if r.random() < 0.5:
            time.sleep(float(r.uniform(0, most_sleep)))
            client.cancel(handle.request_id, stopped=bool(r.random() < 0.3))
        ends.append(collect(handle, timeout=120)[1])

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, seeds, timeout=300))
    assert len(ends) == len(seeds) and all(end[0] == "done" for end in ends), ends


def test_random_load_with_cancellations_leaks_no_page(client):
    rng = np.random.default_rng(1)
    before = client.stats()
    random_load(client, rng.integers(0, 1 << 30, 40).tolist(), 0.3)
    stats = wait_for(lambda: (s := client.stats()).requests_finished + s.requests_cancelled
                     >= before.requests_finished + before.requests_cancelled + 40 and s)
    assert stats and stats.pages_used == 0 and stats.running == 0 and stats.waiting == 0 and client.in_flight == 0
    assert stats.requests_finished + stats.requests_cancelled == before.requests_finished + \
        before.requests_cancelled + 40


def test_the_core_refuses_what_the_engine_cannot_run_before_sending(client):
    from enginesmith.core.errors import UserError

    with pytest.raises(UserError, match="positions|pages"):
        client.submit([1] * 10, 100000)
    with pytest.raises(UserError, match="empty prompt"):
        client.submit([], 4)


# ----------------------------------------------------------------------------- the HTTP server over the core

@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):  # noqa: F811
    s = Server(tmp_path_factory.mktemp("core"), engine, *CORE, env={"ENGINESMITH_API_KEY": KEY})
    try:
        yield s.wait_ready()
    finally:
        pid = CORE_PID.search(s.err.read_text())
        s.stop()
        if pid:
            wait_for(lambda: not running(int(pid.group(1))), timeout=15)
            kill(int(pid.group(1)))
    assert "Traceback" not in s.err.read_text()


def test_serve_over_the_core_answers_as_the_oracle(server, oracle):  # noqa: F811
    client = server.client()
    ids, expected = oracle(PROMPTS[0], 24)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    text, finish, use = streamed(client, False, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert (text, finish, use.completion_tokens) == (expected.text, expected.finish_reason, len(expected.token_ids))
    messages = [{"role": "user", "content": "Name a colour."}]
    _, chat = oracle(messages, 20)
    text, finish, _ = streamed(client, True, messages=messages, max_tokens=20, temperature=0)
    assert (text, finish) == (chat.text, chat.finish_reason)
    answers = concurrent_answers(server.client, 12, 16)
    assert answers == [(e.text, e.finish_reason) for e in (oracle(p, 16)[1] for p in PROMPTS[:12])]


def test_a_stop_string_through_the_core_counts_as_finished(server, oracle):  # noqa: F811
    words = oracle(PROMPTS[1], 24)[1].text.split()
    expected = oracle(PROMPTS[1], 24, stop=[words[2]])[1].text
    before = server.metrics()["enginesmith_requests_total"]
    r = server.client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                           stop=[words[2]])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")
    done = wait_for(lambda: server.metrics()["enginesmith_requests_total"]['{outcome="finished"}']
                    == before['{outcome="finished"}'] + 1)
    assert done and server.metrics()["enginesmith_requests_total"]['{outcome="cancelled"}'] == \
        before['{outcome="cancelled"}']


def test_a_disconnect_through_the_core_gives_its_pages_back(server):
    before = server.metrics()["enginesmith_requests_total"]['{outcome="cancelled"}']
    stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    assert server.metrics()["enginesmith_kv_pages_used"][""] > 0
    stream.close()

    def back():
        m = server.metrics()
        return (m["enginesmith_kv_pages_used"][""] == 0 and m["enginesmith_requests_running"][""] == 0
                and m["enginesmith_requests_total"]['{outcome="cancelled"}'] == before + 1)
    assert wait_for(back), server.metrics()
    assert server.http("GET", "/health").json() == {"status": "ok"}


def test_a_flood_gets_429_and_sigterm_drains_through_the_core(engine, tmp_path):  # noqa: F811
    s = Server(tmp_path, engine, *CORE, "--max-batch", "1", "--max-waiting", "1", env={"ENGINESMITH_API_KEY": KEY})
    pid = None
    try:
        s.wait_ready()
        pid = core_pid(s)

        def ask(i):
            return s.http("POST", "/v1/completions", json={"model": MODEL, "prompt": PROMPTS[i], "max_tokens": 24,
                                                           "temperature": 0, "ignore_eos": True})
        with ThreadPoolExecutor(8) as pool:
            codes = [r.status_code for r in pool.map(ask, range(8), timeout=120)]
        assert 429 in codes and 200 in codes and set(codes) <= {200, 429}, codes
        stream = iter(s.client().completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=40, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        s.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: s.http("GET", "/health").status_code == 503, timeout=10)
        assert sum(1 for _ in stream) >= 1  # the stream runs to its end
        assert s.proc.wait(timeout=30) == 0
        assert wait_for(lambda: not running(pid), timeout=15)
    finally:
        s.stop()
        if pid:
            kill(pid)


def test_a_killed_core_stops_the_server_with_one_line(engine, tmp_path):  # noqa: F811
    s = Server(tmp_path, engine, *CORE, env={"ENGINESMITH_API_KEY": KEY})
    pid = None
    try:
        s.wait_ready()
        pid = core_pid(s)
        stream = iter(s.client().completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=400, temperature=0,
                                                    stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        os.kill(pid, signal.SIGKILL)
        assert s.proc.wait(timeout=30) == 1
        err = s.err.read_text()
        lines = [line for line in err.splitlines() if "stopped:" in line]
        assert lines == [f"enginesmith serve: stopped: the engine core (pid {pid}) was killed by SIGKILL; its "
                         "requests ended with an error"], err
        assert "Traceback" not in err
    finally:
        s.stop()
        if pid:
            kill(pid)


def test_a_killed_front_end_makes_the_core_free_its_pages_and_exit(engine, tmp_path):  # noqa: F811
    s = Server(tmp_path, engine, *CORE, env={"ENGINESMITH_API_KEY": KEY})
    pid = None
    try:
        s.wait_ready()
        pid = core_pid(s)
        streams = []
        for i in range(3):
            streams.append(iter(s.client().completions.create(
                model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0, stream=True,
                extra_body={"ignore_eos": True})))
            next(streams[-1])
        assert s.metrics()["enginesmith_kv_pages_used"][""] > 0
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(timeout=10)
        assert wait_for(lambda: not running(pid), timeout=20)
        line = wait_for(lambda: re.search(r"engine core \(pid \d+\): the front end .* gone; cancelled (\d+) "
                                          r"requests, KV pages in use: (\d+); exiting", s.err.read_text()))
        assert line and line.group(1) == "3" and line.group(2) == "0", s.err.read_text()
    finally:
        s.stop()
        if pid:
            kill(pid)


# ----------------------------------------------------------------------------- on the GPU (device machine)

@pytest.mark.gpu
@needs_cuda
def test_gpu_the_core_process_runs_the_cuda_paged_engine(paged_dir):  # noqa: F811
    """The core opens the CUDA paged engine (tiny llama, head size 64, fp16) in a process of its own,
    with its own CUDA context and graphs. Requests sent one at a time get the in-process loop's greedy
    tokens: one at a time, so both sides run batches of one row and cuBLAS sees the same shapes (batched,
    only the engine's batch-invariant mode promises equal tokens). Then 40 concurrent requests, half
    cancelled, leave no page held and nothing in flight."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 49152, int(n)).tolist() for n in rng.integers(1, 60, 6)]
    c = CoreClient.start(CoreSpec(str(paged_dir), "cuda", max_batch=MAX_BATCH, num_pages=PAGES, chunk=CHUNK),
                         max_waiting=64, timeout=300)
    try:
        got = [collect(c.submit(p, 24), timeout=120) for p in prompts]
        assert all(end == ("done", "length", None) for _, end in got)
        assert [tokens for tokens, _ in got] == in_process(paged_dir, prompts, 24, device="cuda")
        random_load(c, list(range(40)), 0.05)
        stats = wait_for(lambda: (s := c.stats()).running == 0 and s.waiting == 0 and s, timeout=60)
        assert stats and stats.pages_used == 0 and c.in_flight == 0
    finally:
        c.close()
        kill(c.pid)


def test_auto_puts_the_core_in_a_process_on_a_gpu_and_in_a_thread_on_the_cpu():
    from enginesmith.serving.engine_core import core_placement

    assert core_placement("auto", "cuda") == "process" and core_placement("auto", "cpu") == "thread"
    assert core_placement("thread", "cuda") == "thread" and core_placement("process", "cpu") == "process"
    with pytest.raises(UserError, match="engine core placement 'gpu' is not one of auto, thread, process"):
        core_placement("gpu", "cpu")
