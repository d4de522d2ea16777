"""`enginesmith serve --replicas 2`: one front door over two replica processes, as real processes on 127.0.0.1.

The tiny paged CPU engine (the `paged_engine` fixture) is served by two replicas behind the front
door; the oracle is runtime.decoding.generate.generate on the same engine in this process, which
tests/serving/test_serve.py shows a single server answers exactly (greedy):
  - whole and streamed completions and chat through the front door equal the oracle;
  - 16 concurrent clients each get their own answer, and both replicas' metrics show requests;
  - 401 without the key or with a wrong one (the front door's own check); /health and /metrics open;
  - a client that disconnects, mid-stream or before a whole answer, frees its pages at its replica;
  - SIGTERM drains every stream through the front door, exits 0, and no replica process remains;
  - a replica that dies: /health 503, the server exits 1 saying which, the other replica is stopped;
  - a replica that cannot start: one error line, exit 2, no child left.
Units: the metrics relabelling, the routing choice, --devices validation, CUDA_VISIBLE_DEVICES mapping.
On a GPU machine (marked gpu): --devices over up to two GPUs with a --for-cuda paged engine.
Every process is stopped by its PID in finalizers; every wait is bounded.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers.external import needs_cuda, require_module
from test_serve import (KEY, MODEL, PROMPTS, RUN_DIR, Server, answer, concurrent_answers, parse_prometheus, streamed,
                        wait_for)

openai = require_module("openai", "pip install openai")

from enginesmith.core.errors import UserError  # noqa: E402
from enginesmith.serving.door_board import DoorBoard  # noqa: E402
from enginesmith.serving.front_door import Router, relabel_metrics  # noqa: E402
from enginesmith.serving.replicas import cuda_visible  # noqa: E402

REPLICA = re.compile(r"replica (\d+) \([^)]*, pid (\d+)\) at http://")
WORKER = re.compile(r"front-door worker (\d+) \(pid (\d+)\)")


def replica_pids(server: Server) -> list[int]:
    return [int(pid) for _, pid in REPLICA.findall(server.err.read_text())]


def worker_pids(server: Server) -> list[int]:
    return [int(pid) for _, pid in WORKER.findall(server.err.read_text())]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_all(server: Server) -> None:
    """The front door, then any replica it left (by PID): nothing outlives a test."""
    pids = replica_pids(server) + worker_pids(server)
    server.stop()
    for pid in pids:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def by_replica(samples: dict, name: str, labels: str = "") -> dict[str, float]:
    """{replica index: value} of one metric's samples (its other labels exactly `labels`)."""
    out = {}
    for key, value in samples.get(name, {}).items():
        match = re.fullmatch(r'\{replica="(\d+)"(?:,(.*))?\}', key)
        if match and (match.group(2) or "") == labels:
            out[match.group(1)] = value
    return out


@pytest.fixture(scope="module")
def oracle(paged_engine):
    """oracle(prompt | messages, max_tokens) -> Completion of greedy generate() on the served engine."""
    from enginesmith.runtime.text.chat import encode_chat, encode_prompt, stop_token_ids
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate
    from enginesmith.runtime.load import open_engine

    loaded = open_engine(paged_engine, device="cpu", threads=1)
    stops = stop_token_ids(loaded.tokenizer, loaded.manifest)
    lock = threading.Lock()

    def run(prompt, max_tokens: int):
        ids = encode_prompt(loaded.tokenizer, prompt, raw=True) if isinstance(prompt, str) else \
            encode_chat(loaded.tokenizer, prompt)
        config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=stops, max_positions=loaded.context_limit)
        with lock:
            return generate(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id)[0]

    return run


@pytest.fixture(scope="module")
def door(paged_engine, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("door"), paged_engine, "--replicas", "2", "--door-workers", "2",
               env={"ENGINESMITH_API_KEY": KEY})
    try:
        s.wait_ready()
        assert len(replica_pids(s)) == 2 and len(worker_pids(s)) == 1, s.err.read_text()
        yield s
    finally:
        stop_all(s)
    assert "Traceback" not in s.err.read_text()


# ----------------------------------------------------------------------------- answers

def test_answers_through_the_front_door_equal_the_oracle(door, oracle):
    client = door.client()
    expected = oracle(PROMPTS[0], 24)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected.text, expected.finish_reason)
    assert whole.usage.completion_tokens == len(expected.token_ids)
    text, finish, use = streamed(client, False, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert (text, finish, use.completion_tokens) == (expected.text, expected.finish_reason, len(expected.token_ids))
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = oracle(messages, 12)
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert answer.choices[0].message.content == chat.text
    assert streamed(client, True, messages=messages, max_tokens=12, temperature=0)[0] == chat.text
    assert [m.id for m in client.models.list()] == [MODEL]


def test_16_concurrent_clients_get_their_answers_from_both_replicas(door, oracle):
    before = by_replica(door.metrics(), "enginesmith_requests_total", 'outcome="finished"')
    expected = [oracle(p, 12) for p in PROMPTS[:16]]
    answers = concurrent_answers(door.client, 16, 12)
    assert answers == [(e.text, e.finish_reason) for e in expected]
    after = by_replica(door.metrics(), "enginesmith_requests_total", 'outcome="finished"')
    served = {r: after[r] - before[r] for r in after}
    assert set(served) == {"0", "1"} and sum(served.values()) == 16
    assert min(served.values()) >= 4, served  # least-busy routing spreads them (8 and 8 when all overlap)


def test_the_front_door_checks_the_key(door):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    for key in (None, KEY + "x"):
        r = door.http("POST", "/v1/completions", key=key, json=body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    with pytest.raises(openai.AuthenticationError):
        door.client(key="wrong").models.list()
    assert door.http("POST", "/v1/completions", json=body).status_code == 200
    health = door.http("GET", "/health", key=None)
    assert health.status_code == 200 and [r["status"] for r in health.json()["replicas"]] == ["ok", "ok"]
    rejected = door.metrics()["enginesmith_front_door_rejected_total"]['{reason="unauthorized"}']
    assert rejected >= 2
    # replica errors pass through as they are: a bad field is the replica's 400
    bad = door.http("POST", "/v1/completions", json={**body, "n": 2})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_a_client_that_disconnects_frees_its_pages(door):
    def cancelled() -> float:
        return sum(by_replica(door.metrics(), "enginesmith_requests_total", 'outcome="cancelled"').values())

    before = cancelled()
    stream = door.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()

    def give_up(i: int):  # whole answers (16, 8 in each batch: about a second): the client leaves after 0.2 s,
        with pytest.raises(openai.APITimeoutError):  # before its replica has sent anything
            door.client(timeout=0.2).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=400,
                                                        temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(give_up, range(16), timeout=60))

    def pages_back():
        m = door.metrics()
        used = by_replica(m, "enginesmith_kv_pages_used")
        return set(used) == {"0", "1"} and not any(used.values()) and cancelled() >= before + 17 \
            and not any(by_replica(m, "enginesmith_front_door_requests_in_flight").values())
    assert wait_for(pages_back), door.metrics()


# ----------------------------------------------------------------------------- stopping

def test_sigterm_drains_every_stream_then_exits_0_with_no_replica_left(paged_engine, tmp_path):
    server = Server(tmp_path, paged_engine, "--replicas", "2", "--door-workers", "2", "--max-batch", "1",
                    "--drain-timeout", "60").wait_ready()
    try:
        pids = replica_pids(server) + worker_pids(server)
        assert len(pids) == 2 + 1  # two replicas, one front-door worker beside the supervisor
        results: dict[int, tuple] = {}
        started = threading.Semaphore(0)

        def stream(i: int):  # 6 streams, 3 at each replica, one after the other there (--max-batch 1)
            finish, n = None, 0
            for chunk in server.client(key=None, timeout=120).completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    if finish is None and choice.text is not None:
                        started.release()
                    finish = choice.finish_reason or finish
            results[i] = finish, n, time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert started.acquire(timeout=60) and started.acquire(timeout=60)  # streaming at both replicas

        def submitted():
            m = server.metrics()
            return sum(sum(by_replica(m, name, labels).values()) for name, labels in (
                ("enginesmith_requests_running", ""), ("enginesmith_requests_waiting", ""),
                ("enginesmith_requests_total", 'outcome="finished"'))) >= 6
        assert wait_for(submitted, timeout=30), server.metrics()  # every stream is in before the signal
        server.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: server.http("GET", "/health", key=None).status_code == 503, timeout=10)
        late = server.http("POST", "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        refused_at = time.monotonic()
        assert late.status_code == 503 and late.json()["error"]["code"] == "draining"
        assert int(late.headers["retry-after"]) >= 1
        for t in threads:
            t.join(timeout=120)
        assert {i: r[:2] for i, r in results.items()} == {i: ("length", 400) for i in range(6)}
        assert max(end for _, _, end in results.values()) > refused_at  # streams were still open at the 503
        assert server.proc.wait(timeout=30) == 0
        assert not [pid for pid in pids if pid_alive(pid)]
        assert "Traceback" not in server.err.read_text()
    finally:
        stop_all(server)


def test_a_replica_that_dies_stops_the_server_with_exit_1(paged_engine, tmp_path):
    server = Server(tmp_path, paged_engine, "--replicas", "2").wait_ready()
    try:
        pids = replica_pids(server)
        os.kill(pids[1], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert not [pid for pid in pids if pid_alive(pid)]
        assert f"replica 1 (cpu #1, pid {pids[1]}) exited with status -9 while serving" in server.err.read_text()
    finally:
        stop_all(server)


def test_a_front_door_worker_that_dies_stops_the_server_with_exit_1(paged_engine, tmp_path):
    server = Server(tmp_path, paged_engine, "--replicas", "2", "--door-workers", "3").wait_ready()
    try:
        pids, workers = replica_pids(server), worker_pids(server)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        assert server.proc.wait(timeout=30) == 1
        assert not [pid for pid in pids + workers if pid_alive(pid)]
        assert f"front-door worker 1 (pid {workers[0]}) exited with status -9" in server.err.read_text()
    finally:
        stop_all(server)


def test_a_replica_that_cannot_start_gives_one_line(tiny_engine):
    dense = subprocess.run([sys.executable, "-m", "enginesmith.cli", "serve", "--engine", str(tiny_engine("llama")),
                            "--port", "0", "--threads", "1", "--replicas", "2"],
                           capture_output=True, text=True, timeout=120, cwd=RUN_DIR)
    assert dense.returncode == 2, dense.stderr
    assert dense.stderr.startswith("error: replica ") and "did not start" in dense.stderr and "--kv paged" in dense.stderr
    assert len(dense.stderr.strip().splitlines()) == 1, dense.stderr


# ----------------------------------------------------------------------------- units

def test_metrics_of_several_replicas_become_one_exposition():
    one = ("# HELP enginesmith_requests_running Requests.\n# TYPE enginesmith_requests_running gauge\n"
           "enginesmith_requests_running {n}\n"
           "# HELP enginesmith_requests_total Ended.\n# TYPE enginesmith_requests_total counter\n"
           'enginesmith_requests_total{{outcome="finished"}} {n}\n'
           "# HELP enginesmith_ttft_seconds T.\n# TYPE enginesmith_ttft_seconds histogram\n"
           'enginesmith_ttft_seconds_bucket{{le="0.1"}} {n}\nenginesmith_ttft_seconds_bucket{{le="+Inf"}} {n}\n'
           "enginesmith_ttft_seconds_sum 0.5\nenginesmith_ttft_seconds_count {n}\n")
    lines = relabel_metrics([(0, one.format(n=3)), (1, one.format(n=5))])
    types, samples = parse_prometheus("\n".join(lines))
    assert types == {"enginesmith_requests_running": "gauge", "enginesmith_requests_total": "counter",
                     "enginesmith_ttft_seconds": "histogram"}
    assert sum(line.startswith("# HELP ") for line in lines) == 3  # once per family, not per replica
    assert samples["enginesmith_requests_running"] == {'{replica="0"}': 3, '{replica="1"}': 5}
    assert samples["enginesmith_requests_total"] == {'{replica="0",outcome="finished"}': 3,
                                                     '{replica="1",outcome="finished"}': 5}
    assert samples["enginesmith_ttft_seconds_bucket"]['{replica="1",le="+Inf"}'] == 5
    # each family's lines stay together (the format's rule): running, running, total, total, then the histogram
    names = [line.split("{")[0] for line in lines if not line.startswith("#")]
    assert names[:4] == ["enginesmith_requests_running"] * 2 + ["enginesmith_requests_total"] * 2
    assert names[4:] == ["enginesmith_ttft_seconds_bucket"] * 2 + ["enginesmith_ttft_seconds_sum",
                         "enginesmith_ttft_seconds_count"] + ["enginesmith_ttft_seconds_bucket"] * 2 + \
        ["enginesmith_ttft_seconds_sum", "enginesmith_ttft_seconds_count"]


def test_routing_takes_the_least_busy_replica_and_round_robin_on_ties():
    board = DoorBoard(workers=2, replicas=3)
    router, other = Router(board, 0), Router(board, 1)
    assert [router.acquire() for _ in range(3)] == [0, 1, 2]  # all idle: round robin
    router.release(1)
    assert router.acquire() == 1  # the only one with fewer in flight
    assert [router.acquire() for _ in range(3)] == [2, 0, 1]  # a tie again: on from where it left off
    router.release(0), router.release(0)
    assert other.acquire() == 0  # the other worker sees this one's requests: 0 is the least busy of all
    assert [board.in_flight(i) for i in range(3)] == [1, 2, 2] and board.in_flight_of(1) == 1
    other.release(0)
    board.mark_down(0)  # a replica that is down gets nothing, however idle
    assert router.choose() in (1, 2) and [board.in_flight(i) for i in range(3)] == [0, 2, 2]
    board.mark_down(1), board.mark_down(2)
    assert router.acquire() is None
    with pytest.raises(AssertionError):
        router.release(0)


def _devices(text: str, gpus: int, monkeypatch):
    from enginesmith.cli import serve

    monkeypatch.setattr(serve, "_gpu_count", lambda: gpus)
    return serve._check_devices(argparse.Namespace(devices=text), "cuda")


@pytest.mark.parametrize("text, gpus, message", [
    ("0,0", 2, "names a GPU twice"), ("0,-1", 2, "'-1' is not a GPU id"), ("a", 2, "not a GPU id"),
    ("0,2", 2, "torch sees 2 GPU(s)"), ("", 0, "not a GPU id")])
def test_bad_devices_are_refused(text, gpus, message, monkeypatch):
    with pytest.raises(UserError, match=re.escape(message)):
        _devices(text, gpus, monkeypatch)


def test_devices_and_what_each_replica_sees(monkeypatch):
    assert _devices("1, 0", 2, monkeypatch) == [1, 0]
    assert _devices("3", 0, monkeypatch) == [3]  # torch sees no GPU here: the replicas will say
    assert cuda_visible([1, 0], {}) == ["1", "0"]
    assert cuda_visible([1], {"CUDA_VISIBLE_DEVICES": "2,3"}) == ["3"]  # numbered as this process sees them
    with pytest.raises(UserError, match="shows 2"):
        cuda_visible([2], {"CUDA_VISIBLE_DEVICES": "2,3"})
    from enginesmith.cli import serve
    with pytest.raises(UserError, match="--device cuda"):
        serve._check_devices(argparse.Namespace(devices="0"), "cpu")
    assert serve._check_devices(argparse.Namespace(devices=None), "cpu") is None


# ----------------------------------------------------------------------------- one replica per GPU

@pytest.mark.gpu
@needs_cuda
def test_gpu_devices_one_replica_per_gpu(ort_ops_lib, tmp_path):
    """--devices over the GPUs there are (two at most): concurrent clients get what each gets alone (greedy,
    fp16, batch-invariant steps), every replica serves some, SIGTERM exits 0 with no replica left."""
    import torch

    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    gpus = list(range(min(2, torch.cuda.device_count())))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    paged = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=256, kv_layout="paged", page_size=16,
                              max_batch=32), tmp_path / "engine", source=src, progress=False)
    server = Server(tmp_path, paged, "--device", "cuda", "--devices", ",".join(map(str, gpus)), "--model-name", MODEL,
                    # a fixed pool: a share of the GPU's memory is what other test processes leave (H100, -n 6:
                    # "the KV pool would have -3140106 pages")
                    "--num-pages", "512",
                    env={"ENGINESMITH_ORT_OPS_LIB": str(ort_ops_lib)}).wait_ready(timeout=300)
    try:
        pids = replica_pids(server)
        assert len(pids) == len(gpus) and all(f"(GPU {g}, pid" in server.err.read_text() for g in gpus)

        def new_client():
            return server.client(key=None)

        alone = [answer(new_client(), i, 32) for i in range(24)]
        assert concurrent_answers(new_client, 24, 32) == alone
        served = by_replica(server.metrics(), "enginesmith_requests_total", 'outcome="finished"')
        assert len(served) == len(gpus) and min(served.values()) > 0, served
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        assert not [pid for pid in pids if pid_alive(pid)]
    finally:
        stop_all(server)
    assert "Traceback" not in server.err.read_text()
