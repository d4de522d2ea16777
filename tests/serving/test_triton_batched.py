"""The Triton model on a paged engine, in-process (Triton's python backend stood in by fake_triton),
its scheduler loop in the model's process or in an engine core process (ENGINE_CORE): all requests
share one scheduler loop, each gets the tokens it gets alone and its text; a stop
string ends the text before it; beyond MAX_WAITING a request gets an "overloaded" UNAVAILABLE
error; a client's cancel ends its request and gives its pages back; an unload ends open streams with
the stopping error; a bad request gets INVALID_ARG. A killed core ends its requests with an error
naming it. An engine without paged KV still takes the worker path."""

from __future__ import annotations

import os
import signal
import time

import pytest

from fake_triton import Request, start_model

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.text.chat import encode_prompt, stop_token_ids
from enginesmith.runtime.decoding.generate import GenerationConfig, generate
from enginesmith.runtime.load import open_engine, paged_model
from enginesmith.serving.core_client import CoreClient

PROMPTS = [f"Tell me about the number {i}." for i in range(12)]


@pytest.fixture(scope="module")
def alone(paged_engine):
    """alone(prompt, max_tokens) -> greedy token ids of that request run by itself (batch of one)."""
    loaded = open_engine(paged_engine, device="cpu", verify_hashes=False)
    stops = stop_token_ids(loaded.tokenizer, loaded.manifest)

    def run(prompt: str, max_tokens: int) -> list[int]:
        batcher = ContinuousBatcher(paged_model(loaded, 64), SchedulerConfig(max_batch=1))
        rid = batcher.add_request(encode_prompt(loaded.tokenizer, prompt), max_tokens, stops)
        batcher.run()
        return batcher.finished[rid].output

    run.tokenizer = loaded.tokenizer
    run.stops = stops
    return run


@pytest.fixture(params=["thread", "process"])
def model(request, paged_engine, monkeypatch, tmp_path):
    """start(**params) -> (the model, its pb stand-in), its scheduler loop in this process (ENGINE_CORE=thread)
    or in an engine core process (ENGINE_CORE=process, serving/engine_core.py): every test runs on both."""
    started = []

    def start(**params):
        m, pb = start_model(monkeypatch, {"ENGINE_DIR": str(paged_engine), "DEVICE": "cpu", "THREADS": "1",
                                          "VERIFY_HASHES": "0", "ENGINE_CORE": request.param, **params}, tmp_path)
        started.append(m)
        return m, pb

    yield start
    for m in started:
        m.finalize()


def test_requests_share_one_loop_and_get_their_own_tokens(model, alone):
    m, pb = model(MAX_BATCH="8")
    assert m.batched is not None and not m.workers
    if isinstance(m.batched.loop, CoreClient):
        assert any(f"an engine core process (pid {m.batched.loop.pid}; 8 rows per step" in line for line in pb.log)
    else:
        assert any("one scheduler loop (8 rows per step" in line for line in pb.log)
    requests = [Request(text_input=p, max_tokens=10) for p in PROMPTS]
    m.execute(requests[:5])  # two calls: requests join a batch already running
    m.execute(requests[5:])
    for prompt, request in zip(PROMPTS, requests):
        got = request.sender.result()
        assert got["token_ids"] == alone(prompt, 10), prompt
        ids = got["token_ids"][:-1] if got["finish_reason"] == "stop" else got["token_ids"]
        assert got["text"] == alone.tokenizer.decode(ids, skip_special_tokens=True)
        assert got["finish_reason"] == ("stop" if got["token_ids"][-1] in alone.stops else "length")
    stats = m.batched.loop.stats()
    assert stats.requests_finished == len(PROMPTS) and stats.pages_used == 0 and m.batched.open_requests == 0


def test_stop_string_ends_the_text_before_it(model):
    m, _ = model()
    whole = Request(text_input=PROMPTS[0], max_tokens=40)
    m.execute([whole])
    full = whole.sender.result()
    stop = full["text"][len(full["text"]) // 2:][:2]
    assert stop.strip(), full
    cut = Request(text_input=PROMPTS[0], max_tokens=40, stop=[stop])
    m.execute([cut])
    got = cut.sender.result()
    assert got["finish_reason"] == "stop" and got["text"] == full["text"][:full["text"].index(stop)]
    assert got["token_ids"] == full["token_ids"][:len(got["token_ids"])]


def test_beyond_max_waiting_requests_are_refused_as_overloaded(model):
    m, _ = model(MAX_BATCH="1", MAX_WAITING="2")
    requests = [Request(text_input="hi", max_tokens=30) for _ in range(10)]
    m.execute(requests)
    results = [r.sender.result() for r in requests]
    refused = [r for r in results if "error" in r]
    assert refused and all(r["code"] == "UNAVAILABLE" and "overloaded" in r["error"] for r in refused)
    assert len(results) - len(refused) >= 1 and all("token_ids" in r for r in results if "error" not in r)


def test_a_cancelled_request_ends_and_gives_its_pages_back(model):
    m, pb = model()
    request = Request(text_input="Write a long story.", max_tokens=400, temperature=1.0, seed=1)
    m.execute([request])
    assert request.sender.first.wait(30)
    request.cancelled = True  # what the client's cancel looks like to the model
    got = request.sender.result(timeout=10)
    assert got.get("cancelled"), got
    deadline = time.monotonic() + 5
    while m.batched.loop.stats().pages_used and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = m.batched.loop.stats()
    assert stats.pages_used == 0 and stats.requests_cancelled == 1
    assert any("cancelled by the client" in line for line in pb.log)


def test_an_unload_lets_a_request_finish_within_the_drain(model):
    m, pb = model()
    request = Request(text_input="Write a long story.", max_tokens=40, temperature=1.0, seed=2)
    m.execute([request])
    assert request.sender.first.wait(30)
    pb.ready = False  # an unload (or a server shutdown) has begun: DRAIN_S (1 s) for what is in flight
    got = request.sender.result(timeout=10)
    assert got.get("finish_reason") == "length" and len(got["token_ids"]) == 40, got


def test_an_unload_ends_open_streams_with_the_stopping_error(model, monkeypatch):
    from enginesmith.serving import triton_model

    monkeypatch.setattr(triton_model, "DRAIN_S", 0.0)  # the tiny engine would finish any request within 1 s
    m, pb = model(MAX_BATCH="1")  # one at a time: the last ones are still waiting at the unload
    requests = [Request(text_input="Write a long story.", max_tokens=400, temperature=1.0, seed=i) for i in range(4)]
    m.execute(requests)
    assert requests[0].sender.first.wait(30)
    begun = time.monotonic()
    pb.ready = False
    results = [r.sender.result(timeout=10) for r in requests]
    assert time.monotonic() - begun < 4
    stopped = [r for r in results if "error" in r]
    assert stopped and all("the model is being unloaded" in r["error"] and r["code"] == "UNAVAILABLE"
                           for r in stopped), results
    assert all(r.get("finish_reason") == "length" for r in results if "error" not in r)
    late = Request(text_input="hi")
    m.execute([late])
    assert "the model is being unloaded" in late.sender.result(timeout=5)["error"]


@pytest.mark.parametrize("inputs, match", [
    ({"text_input": "hi", "temperature": -1.0}, "temperature"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "x " * 600}, "does not fit the model's context"),
])
def test_a_bad_request_gets_invalid_arg(model, inputs, match):
    m, _ = model()
    request = Request(**inputs)
    m.execute([request])
    got = request.sender.result(timeout=10)
    assert got.get("code") == "INVALID_ARG" and match in got["error"] and "fix:" in got["error"], got


def test_a_long_max_tokens_is_cut_to_the_context(model, alone):
    """As on the one-request path: the answer ends with "length" where the context ends."""
    m, _ = model()
    request = Request(text_input=PROMPTS[1], max_tokens=5000, raw=True)
    m.execute([request])
    got = request.sender.result(timeout=60)
    assert got.get("finish_reason") in ("length", "stop"), got
    prompt_len = len(alone.tokenizer.encode(PROMPTS[1], add_special_tokens=True))
    assert prompt_len + len(got["token_ids"]) <= 512


def test_an_engine_without_paged_kv_takes_the_worker_path(tiny_engine, monkeypatch, tmp_path):
    dense = tiny_engine("llama")
    m, pb = start_model(monkeypatch, {"ENGINE_DIR": str(dense), "DEVICE": "cpu", "WORKERS": "2",
                                      "VERIFY_HASHES": "0"}, tmp_path)
    try:
        assert m.batched is None and len(m.workers) == 2
        loaded = open_engine(dense, device="cpu", verify_hashes=False)
        config = GenerationConfig(max_new_tokens=8, stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest),
                                  max_positions=loaded.max_positions)
        want = generate(loaded.engine, loaded.tokenizer, [encode_prompt(loaded.tokenizer, PROMPTS[2])], config,
                        loaded.pad_id)[0]
        request = Request(text_input=PROMPTS[2], max_tokens=8)
        m.execute([request])
        got = request.sender.result()
        assert (got["token_ids"], got["text"], got["finish_reason"]) == (want.token_ids, want.text, want.finish_reason)
    finally:
        m.finalize()


def test_a_killed_engine_core_ends_its_requests_and_refuses_new_ones(paged_engine, monkeypatch, tmp_path):
    """The core dies (SIGKILL by its PID): the open stream ends with an INTERNAL error naming it, a new
    request gets UNAVAILABLE saying why, the log says so once; finalize still returns."""
    m, pb = start_model(monkeypatch, {"ENGINE_DIR": str(paged_engine), "DEVICE": "cpu", "THREADS": "1",
                                      "VERIFY_HASHES": "0", "ENGINE_CORE": "process"}, tmp_path)
    try:
        pid = m.batched.loop.pid
        request = Request(text_input="Write a long story.", max_tokens=400, temperature=1.0, seed=3)
        m.execute([request])
        assert request.sender.first.wait(30)
        os.kill(pid, signal.SIGKILL)
        got = request.sender.result(timeout=10)
        assert got.get("code") == "INTERNAL" and f"the engine core (pid {pid}) was killed by SIGKILL" in got["error"], got
        late = Request(text_input="hi")
        m.execute([late])
        got = late.sender.result(timeout=5)
        assert got.get("code") == "UNAVAILABLE" and f"the engine core (pid {pid}) was killed by SIGKILL" in got["error"]
    finally:
        m.finalize()
    assert not m.batched.responder.is_alive()


def test_engine_core_auto_keeps_the_loop_here_on_the_cpu_and_a_bad_value_is_refused(paged_engine, monkeypatch,
                                                                                     tmp_path):
    m, _ = start_model(monkeypatch, {"ENGINE_DIR": str(paged_engine), "DEVICE": "cpu", "VERIFY_HASHES": "0"}, tmp_path)
    try:
        assert not isinstance(m.batched.loop, CoreClient)  # auto: a process on a GPU, this process on the CPU
    finally:
        m.finalize()
    with pytest.raises(UserError, match="config parameter ENGINE_CORE='gpu' is not one of auto, thread, process"):
        start_model(monkeypatch, {"ENGINE_DIR": str(paged_engine), "ENGINE_CORE": "gpu"}, tmp_path)


def test_finalize_stops_the_engine_core(paged_engine, monkeypatch, tmp_path):
    m, _ = start_model(monkeypatch, {"ENGINE_DIR": str(paged_engine), "DEVICE": "cpu", "THREADS": "1",
                                     "VERIFY_HASHES": "0", "ENGINE_CORE": "process"}, tmp_path)
    core = m.batched.loop.proc
    assert core.poll() is None
    m.finalize()
    assert core.poll() == 0  # asked to close, it exited by itself, and was reaped: no orphan holds the engine
