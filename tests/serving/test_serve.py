"""`enginesmith serve` as a real process on 127.0.0.1, driven by the official `openai` client.

A tiny paged CPU engine (tiny:llama, random weights, `build --kv paged`) is served; the oracle is
runtime.decoding.generate.generate on the same engine in this process (greedy text, token counts):
  - whole and streamed completions and chat completions equal the oracle, and each other; usage
    counts the prompt and the generated tokens; a stop string ends the text before it;
  - 32 concurrent clients (streamed and whole) each get the answer their request gets alone;
  - a client that disconnects (mid-stream, or before a whole answer is ready) cancels its request:
    /metrics shows its KV pages back and the request counted as cancelled;
  - 400 for bad fields (types as sent, n=2, logprobs, unknown fields and values, sizes), 401 for a
    missing or wrong key (set through $ENGINESMITH_API_KEY), 404 for an unknown model or route, 413
    for an oversized body: all OpenAI-style JSON errors;
  - a server with --max-batch 1 --max-waiting 1 flooded: some requests get 429 with Retry-After, the
    others their answers, none hangs;
  - SIGTERM with streams open: /health and new requests get 503, every stream runs to its end, the
    process exits 0;
  - /metrics parses as Prometheus text with the documented names.
Servers are stopped by PID in finalizers; every wait is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers.external import needs_cuda, require_module

openai = require_module("openai", "pip install openai")
httpx = require_module("httpx", "pip install httpx")
require_module("starlette", "pip install starlette uvicorn")
require_module("uvicorn", "pip install starlette uvicorn")

MODEL = "tiny:llama"
KEY = "test-key-1234"
READY = re.compile(r"enginesmith serve: (http://127\.0\.0\.1:\d+)")
# Where the CLI processes the tests start run: not the checkout, whose enginesmith/ folder would shadow the
# installed package (python -m puts the working directory first on sys.path).
RUN_DIR = Path(tempfile.gettempdir())
PROMPTS = [f"Prompt number {i}: tell me about {w}" for i, w in
           enumerate("cats dogs rivers mountains clouds trains bread music stars ships maps clocks lamps roads "
                     "birds trees stones coins books doors fires winds rains snows hills lakes seas caves "
                     "bells kites forks cups".split())]


class Server:
    """`python -m enginesmith.cli serve ...` on a free port; `url` once it printed its ready line."""

    def __init__(self, tmp: Path, engine: Path, *flags: str, env: dict | None = None):
        self.out, self.err = tmp / "stdout.txt", tmp / "stderr.txt"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "enginesmith.cli", "serve", "--engine", str(engine), "--port", "0",
                 "--threads", "1", *flags], stdout=out, stderr=err, cwd=RUN_DIR, env={**os.environ, **(env or {})})
        self.url = ""

    def wait_ready(self, timeout: float = 60.0) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = READY.search(self.out.read_text())
            if match:
                self.url = match.group(1)
                return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise AssertionError(f"the server did not start: {self.err.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def client(self, key: str | None = KEY, timeout: float = 60.0):
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or "none", max_retries=0, timeout=timeout)

    def http(self, method: str, path: str, key: str | None = KEY, **kwargs):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.request(method, self.url + path, headers=headers, timeout=30, **kwargs)

    def metrics(self) -> dict[str, dict[str, float]]:
        return parse_prometheus(self.http("GET", "/metrics", key=None).text)[1]


def parse_prometheus(text: str) -> tuple[dict[str, str], dict[str, dict[str, float]]]:
    """({name: type}, {name: {labels text: value}}); AssertionError on any line that is not exposition format."""
    types, samples = {}, {}
    sample = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_]+="[^"]*",?)*\})? (\S+)$')
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert kind in ("counter", "gauge", "histogram", "summary", "untyped"), line
            types[name] = kind
        elif line.startswith("# HELP ") or not line:
            continue
        else:
            match = sample.match(line)
            assert match, f"not a Prometheus sample line: {line!r}"
            samples.setdefault(match.group(1), {})[match.group(2) or ""] = float(match.group(3))
    return types, samples


def wait_for(predicate, timeout: float = 15.0, every: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    return predicate()


@pytest.fixture(scope="module")
def engine():
    from enginesmith.builder.engine import BuildConfig, cached_engine

    return cached_engine(BuildConfig(model=MODEL, kv_layout="paged"), progress=False)


@pytest.fixture(scope="module")
def oracle(engine):
    """oracle(prompt | messages, max_tokens, stop=()) -> (prompt ids, Completion) of greedy generate()."""
    from enginesmith.runtime.text.chat import encode_chat, encode_prompt, stop_token_ids
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate
    from enginesmith.runtime.load import open_engine

    loaded = open_engine(engine, device="cpu", threads=1)
    stops = stop_token_ids(loaded.tokenizer, loaded.manifest)
    lock = threading.Lock()

    def run(prompt, max_tokens: int, stop=()):
        ids = encode_prompt(loaded.tokenizer, prompt, raw=True) if isinstance(prompt, str) else \
            encode_chat(loaded.tokenizer, prompt)
        config = GenerationConfig(max_new_tokens=max_tokens, stop_token_ids=stops, stop_strings=tuple(stop),
                                  max_positions=loaded.context_limit)
        with lock:
            return ids, generate(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id)[0]

    return run


@pytest.fixture(scope="module")
def server(engine, tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("serve"), engine, env={"ENGINESMITH_API_KEY": KEY})
    try:
        yield s.wait_ready()
    finally:
        s.stop()
    assert "Traceback" not in s.err.read_text()  # nothing of ours failed behind a client's back


def answer(client, i: int, max_tokens: int) -> tuple[str, str | None]:
    """(text, finish reason) of greedy PROMPTS[i]: streamed for odd i, whole for even i."""
    if i % 2:
        return streamed(client, False, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0)[:2]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=max_tokens, temperature=0)
    return r.choices[0].text, r.choices[0].finish_reason


def concurrent_answers(new_client, n: int, max_tokens: int) -> list[tuple[str, str | None]]:
    """answer(new_client(), i, max_tokens) for i < n, all n at once (one client each)."""
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda i: answer(new_client(), i, max_tokens), range(n), timeout=120))


def streamed(client, chat: bool, **kwargs) -> tuple[str, str | None, object]:
    """(text, finish reason, usage) of a streamed request, joined from its chunks."""
    make = client.chat.completions.create if chat else client.completions.create
    text, finish, use = [], None, None
    for chunk in make(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            use = chunk.usage
        for choice in chunk.choices:
            piece = choice.delta.content if chat else choice.text
            text.append(piece or "")
            finish = choice.finish_reason or finish
    return "".join(text), finish, use


# ----------------------------------------------------------------------------- answers

def test_completion_whole_and_streamed_equal_the_oracle(server, oracle):
    client = server.client()
    ids, expected = oracle(PROMPTS[0], 24)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected.text and whole.choices[0].finish_reason == expected.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    assert whole.usage.total_tokens == len(ids) + len(expected.token_ids)
    text, finish, use = streamed(client, False, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert (text, finish) == (expected.text, expected.finish_reason)
    assert use.completion_tokens == len(expected.token_ids) and use.prompt_tokens == len(ids)
    # a prompt of token ids is the same request
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_chat_whole_and_streamed_equal_the_oracle(server, oracle):
    client = server.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    ids, expected = oracle(messages, 20)
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), len(expected.token_ids))
    text, finish, use = streamed(client, True, messages=messages, max_tokens=20, temperature=0)
    assert (text, finish, use.completion_tokens) == (expected.text, expected.finish_reason, len(expected.token_ids))


def test_a_stop_string_ends_the_text_before_it(server, oracle):
    client = server.client()
    _, full = oracle(PROMPTS[1], 24)
    words = full.text.split()
    assert len(words) >= 4, full.text
    stop = words[2]
    expected = full.text[:full.text.index(stop)]
    assert oracle(PROMPTS[1], 24, stop=[stop])[1].text == expected  # runtime.decoding.generate's stop semantics
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    text, finish, _ = streamed(client, False, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=stop)
    assert (text, finish) == (expected, "stop")


def test_32_concurrent_clients_each_get_their_own_answer(server, oracle):
    expected = [oracle(p, 16)[1] for p in PROMPTS[:32]]
    answers = concurrent_answers(server.client, 32, 16)
    assert answers == [(e.text, e.finish_reason) for e in expected]
    assert len({a[0] for a in answers}) > 1  # different prompts, different answers: nothing was mixed up


# ----------------------------------------------------------------------------- disconnects

def _pages_back_and_cancelled(server, cancelled_before: float, more: int):
    def check():
        m = server.metrics()
        return (m["enginesmith_kv_pages_used"][""] == 0 and m["enginesmith_requests_running"][""] == 0
                and m["enginesmith_requests_total"]['{outcome="cancelled"}'] >= cancelled_before + more)
    return wait_for(check)


def test_a_client_that_disconnects_mid_stream_gives_its_pages_back(server):
    before = server.metrics()["enginesmith_requests_total"]['{outcome="cancelled"}']
    stream = server.client().completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    assert _pages_back_and_cancelled(server, before, 1), server.metrics()


def test_a_client_that_gives_up_on_a_whole_answer_gives_its_pages_back(server):
    before = server.metrics()["enginesmith_requests_total"]['{outcome="cancelled"}']
    # 16 long requests in one batch take about a second; each client waits 0.2 s, then leaves

    def ask(i):
        with pytest.raises(openai.APITimeoutError):
            server.client(timeout=0.2).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=400,
                                                          temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(ask, range(16), timeout=60))
    assert _pages_back_and_cancelled(server, before, 1), server.metrics()


# ----------------------------------------------------------------------------- refusals

def _error(response, status: int, param=None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in response.text
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("body, param", [
    ({"temperature": "0.5"}, "temperature"),            # a number sent as a string
    ({"max_tokens": 16.0}, "max_tokens"),               # a float is not an integer
    ({"max_tokens": True}, "max_tokens"),               # nor is a boolean
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10 ** 30}, "max_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 2}, "n"),
    ({"logprobs": 1}, "logprobs"),
    ({"echo": True}, "echo"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frobnicate": 1}, "frobnicate"),                   # an unknown field
    ({"stream": "yes"}, "stream"),
    ({"stop": ["a"] * 9}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": [49152]}, "prompt"),                     # outside the vocabulary
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),                  # several prompts
    ({"prompt": list(range(600))}, None),                # longer than the engine's 512 positions
    ({"prompt": "hi", "max_tokens": 600}, None),
    ({"seed": -1}, "seed"),
])
def test_bad_completion_fields_get_400(server, body, param):
    full = {"model": MODEL, "prompt": "Hello", **body}
    _error(server.http("POST", "/v1/completions", json=full), 400, param)


@pytest.mark.parametrize("messages", [
    [], "hello", [{"role": "robot", "content": "hi"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    [{"role": "user", "content": "hi", "tool_calls": []}],
])
def test_bad_chat_messages_get_400(server, messages):
    _error(server.http("POST", "/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400, "messages")


def test_bodies_that_are_not_json_objects_get_400_and_big_ones_413(server):
    for raw in (b"{", b"[1, 2]", b'{"model": NaN}', b"\xff\xfe", b"[" * 100000):
        _error(server.http("POST", "/v1/completions", content=raw), 400)
    _error(server.http("POST", "/v1/completions", content=b" " * (5 << 20)), 413)


def test_the_official_client_sees_the_refusals(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=MODEL, prompt="Hello", n=2)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="Hello")
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").completions.create(model=MODEL, prompt="Hello")
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert [m.id for m in client.models.list()] == [MODEL]


def test_keys_routes_and_open_endpoints(server):
    error = _error(server.http("POST", "/v1/completions", key=None, json={"model": MODEL, "prompt": "x"}), 401)
    assert error["code"] == "invalid_api_key"
    _error(server.http("POST", "/v1/completions", key=KEY + "x", json={"model": MODEL, "prompt": "x"}), 401)
    _error(server.http("GET", "/v1/models/other"), 404, "model")
    assert server.http("GET", f"/v1/models/{MODEL}").json()["id"] == MODEL
    _error(server.http("GET", "/v1/nothing"), 404)
    _error(server.http("GET", "/v1/completions"), 405)
    assert server.http("GET", "/health", key=None).status_code == 200


def test_metrics_are_prometheus_text_with_the_documented_names(server):
    server.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    response = server.http("GET", "/metrics", key=None)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    types, samples = parse_prometheus(response.text)
    p = "enginesmith_"
    expected = {"requests_running": "gauge", "requests_waiting": "gauge", "kv_pages_used": "gauge",
                "kv_pages_total": "gauge", "prompt_tokens_total": "counter", "generation_tokens_total": "counter",
                "requests_total": "counter", "requests_rejected_total": "counter",
                "generation_tokens_per_second": "gauge", "time_to_first_token_seconds": "histogram",
                "inter_token_latency_seconds": "histogram"}
    assert {p + k: v for k, v in expected.items()}.items() <= types.items()
    assert samples[p + "generation_tokens_total"][""] >= 4 and samples[p + "kv_pages_total"][""] > 0
    assert samples[p + "requests_total"]['{outcome="finished"}'] >= 1
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        buckets = samples[f"{p}{name}_bucket"]
        counts = list(buckets.values())
        assert counts == sorted(counts) and list(buckets)[-1] == '{le="+Inf"}'
        assert buckets['{le="+Inf"}'] == samples[f"{p}{name}_count"][""] > 0
    assert samples[p + "time_to_first_token_seconds_count"][""] >= 1


# ----------------------------------------------------------------------------- overload and shutdown

def test_overload_gets_429_with_retry_after_and_nothing_hangs(engine, tmp_path):
    server = Server(tmp_path, engine, "--max-batch", "1", "--max-waiting", "1").wait_ready()
    try:
        def ask(i: int):
            try:
                r = server.client(key=None, timeout=60).completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=100, temperature=0, extra_body={"ignore_eos": True})
                return "ok", r.usage.completion_tokens
            except openai.RateLimitError as exc:
                return "429", exc.response.headers.get("retry-after")

        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(ask, range(16), timeout=120))
        refused = [r for kind, r in results if kind == "429"]
        served = [r for kind, r in results if kind == "ok"]
        assert refused and served, results
        assert all(r is not None and int(r) >= 1 for r in refused)
        assert all(n == 100 for n in served)
        rejected = server.metrics()["enginesmith_requests_rejected_total"]['{reason="overloaded"}']
        assert rejected == len(refused)
    finally:
        server.stop()


def test_sigterm_drains_open_streams_then_exits_0(engine, tmp_path):
    server = Server(tmp_path, engine, "--max-batch", "1", "--drain-timeout", "60").wait_ready()
    try:
        results: dict[int, tuple] = {}
        first_chunk = threading.Event()

        def stream(i: int):  # 6 streams one after another (--max-batch 1): seconds of work in flight
            text, finish, n = [], None, 0
            for chunk in server.client(key=None, timeout=120).completions.create(
                    model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
                first_chunk.set()
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    text.append(choice.text)
                    finish = choice.finish_reason or finish
            results[i] = finish, n, time.monotonic()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        def submitted():
            m = server.metrics()
            return (m["enginesmith_requests_total"]['{outcome="finished"}'] + m["enginesmith_requests_running"][""]
                    + m["enginesmith_requests_waiting"][""]) >= 6
        assert wait_for(submitted, timeout=30)  # every stream is in before the signal
        server.proc.send_signal(signal.SIGTERM)
        health = wait_for(lambda: server.http("GET", "/health", key=None).status_code == 503, timeout=10)
        assert health, "health did not turn 503 while draining"
        late = server.http("POST", "/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2})
        refused_at = time.monotonic()
        assert _error(late, 503)["code"] == "draining" and int(late.headers["retry-after"]) >= 1
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == list(range(6))
        assert all(finish == "length" and n == 400 for finish, n, _ in results.values()), results
        assert max(end for _, _, end in results.values()) > refused_at  # streams were still open at the 503
        assert server.proc.wait(timeout=30) == 0
        assert "Traceback" not in server.err.read_text()
    finally:
        server.stop()


def test_bad_flags_and_engines_fail_in_one_line(engine, tiny_engine):
    def serve(*flags):
        return subprocess.run([sys.executable, "-m", "enginesmith.cli", "serve", *flags], capture_output=True,
                              text=True, timeout=120, cwd=RUN_DIR)

    dense = serve("--engine", str(tiny_engine("llama")), "--port", "0")
    assert dense.returncode == 2 and "--kv paged" in dense.stderr and len(dense.stderr.strip().splitlines()) == 1
    bad = serve("--engine", str(engine), "--port", "70000")
    assert bad.returncode == 2 and "--port" in bad.stderr
    devices = serve("--engine", str(engine), "--device", "cpu", "--devices", "0,1")
    assert devices.returncode == 2 and "--device cuda" in devices.stderr


# ----------------------------------------------------------------------------- the CUDA paged engine

@pytest.mark.gpu
@needs_cuda
def test_gpu_paged_engine_serves_concurrent_clients_as_alone(ort_ops_lib, tmp_path, monkeypatch):
    """A --for-cuda --kv paged engine on the GPU: 24 concurrent clients get what each gets alone
    (greedy, fp16: the batch-invariant steps); a disconnect gives the pages back."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    paged = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=256, kv_layout="paged", page_size=16,
                              max_batch=32), tmp_path / "engine", source=src, progress=False)
    # a fixed pool: a share of the GPU's memory is what other test processes leave (H200, the engine of the
    # pool-sizing test still held: "the KV pool would have -53885 pages")
    server = Server(tmp_path, paged, "--device", "cuda", "--model-name", MODEL, "--num-pages", "512",
                    env={"ENGINESMITH_ORT_OPS_LIB": str(ort_ops_lib)}).wait_ready(timeout=300)
    try:
        def ask(i: int):
            if i % 2:
                return streamed(server.client(key=None), False, prompt=PROMPTS[i], max_tokens=32, temperature=0)[:2]
            r = server.client(key=None).completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=32,
                                                           temperature=0)
            return r.choices[0].text, r.choices[0].finish_reason

        alone = [ask(i) for i in range(24)]
        with ThreadPoolExecutor(24) as pool:
            assert list(pool.map(ask, range(24), timeout=120)) == alone
        before = server.metrics()["enginesmith_requests_total"]['{outcome="cancelled"}']
        stream = server.client(key=None).completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200,
                                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks), next(chunks)
        stream.close()
        assert _pages_back_and_cancelled(server, before, 1), server.metrics()
    finally:
        server.stop()
    assert "Traceback" not in server.err.read_text()
