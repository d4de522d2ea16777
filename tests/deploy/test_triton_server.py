"""A real tritonserver (nvidia-pytriton 0.7.0, Triton 2.51, CPU) serving the default SmolLM2 engine.

Streams over gRPC and HTTP SSE must give exactly the token ids of greedy `generate()` on the same
engine; 8 concurrent clients must each get their own complete answer; invalid parameters get an error
response and the model keeps serving; the server is stopped by PID and leaves nothing behind.
The tests in this module run in order and share one server (started once, ~15 s).
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from triton_server import TritonServer, model_env, pytriton_root  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2"
MAX_TOKENS = 24
PROMPTS = [
    "What is the capital of France?",
    "What is the capital of Italy?",
    "Name three colors.",
    "What is 2 + 2?",
    "Say hello in Spanish.",
    "What is the largest planet?",
    "Write one word that rhymes with cat.",
    "Who wrote Hamlet?",
]


def _require(module: str, install: str) -> None:
    try:
        __import__(module)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is missing in CI: {install}")
        pytest.skip(f"{module} not installed ({install})")


@pytest.fixture(scope="module")
def direct(smollm2_engine):
    """The same engine opened in-process: greedy generate() is the oracle."""
    from enginesmith.runtime.chat import encode_prompt, stop_token_ids
    from enginesmith.runtime.generate import GenerationConfig, generate
    from enginesmith.runtime.load import open_engine

    loaded = open_engine(smollm2_engine, device="cpu", verify_hashes=False)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest),
                              max_positions=loaded.max_positions)
    cache: dict[str, object] = {}

    def expected(prompt: str):
        if prompt not in cache:
            ids = encode_prompt(loaded.tokenizer, prompt)
            cache[prompt] = generate(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id)[0]
        return cache[prompt]

    return expected


@pytest.fixture(scope="module")
def server(smollm2_engine, tmp_path_factory):
    _require("tritonclient.grpc", "pip install 'tritonclient[grpc,http]'")
    if pytriton_root() is None:
        if os.environ.get("CI"):
            pytest.fail("nvidia-pytriton is missing in CI: pip install --no-deps nvidia-pytriton==0.7.0")
        pytest.skip("tritonserver not installed (pip install --no-deps nvidia-pytriton==0.7.0)")
    from enginesmith.deploy.triton import write_model_repository

    work = tmp_path_factory.mktemp("triton")
    write_model_repository(smollm2_engine, work / "repo", MODEL, execution_env=model_env(), device="cpu",
                           workers=2, verify_hashes=True, max_tokens=MAX_TOKENS)
    srv = TritonServer(work / "repo", work)
    try:
        srv.start([MODEL])
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


# ----------------------------------------------------------------------------- clients

def grpc_stream(url: str, prompt: str | None, **params) -> dict:
    """One streamed request over gRPC: {"text", "token_ids", "finish_reason", "chunks"} or {"error"}."""
    import tritonclient.grpc as grpcclient

    types = {"max_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32), "top_k": ("INT32", np.int32),
             "top_p": ("FP32", np.float32), "repetition_penalty": ("FP32", np.float32), "seed": ("INT64", np.int64)}
    inputs = []
    if prompt is not None:
        inputs.append(grpcclient.InferInput("text_input", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    for name, value in params.items():
        triton_type, np_type = types[name]
        inputs.append(grpcclient.InferInput(name, [1], triton_type))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=np_type))
    results: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(MODEL, inputs)
        out: dict = {"text": "", "chunks": 0}
        while True:
            result, error = results.get(timeout=300)
            if error is not None:
                return {"error": str(error)}
            out["text"] += result.as_numpy("text_output")[0].decode()
            out["chunks"] += 1
            finish = result.as_numpy("finish_reason")
            if finish is not None:
                out["finish_reason"] = finish[0].decode()
                out["token_ids"] = result.as_numpy("token_ids").tolist()
                return out
    finally:
        client.stop_stream()
        client.close()


def http_stream(url: str, body: dict) -> dict:
    """One request to /generate_stream (SSE): same shape as grpc_stream, plus "status"."""
    request = urllib.request.Request(f"http://{url}/v2/models/{MODEL}/generate_stream",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            status, payload = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, payload = exc.code, exc.read().decode()
    out: dict = {"status": status, "text": "", "chunks": 0}
    for line in payload.splitlines():
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: "):])
        if "error" in event:
            out["error"] = event["error"]
            continue
        out["text"] += event.get("text_output", "")
        out["chunks"] += 1
        if "finish_reason" in event:
            out["finish_reason"], out["token_ids"] = event["finish_reason"], event["token_ids"]
    return out


# ----------------------------------------------------------------------------- tests (in order)

def test_grpc_stream_matches_greedy_generate(server, direct):
    prompt = PROMPTS[0]
    want = direct(prompt)
    got = grpc_stream(server.grpc_url, prompt)
    assert got.get("error") is None, got
    assert got["token_ids"] == want.token_ids
    assert got["text"] == want.text == "The capital of France is Paris."
    assert got["finish_reason"] == want.finish_reason == "stop"
    assert got["chunks"] > 2  # streamed, not one blob


def test_http_generate_stream_matches_greedy_generate(server, direct):
    prompt = PROMPTS[0]
    want = direct(prompt)
    got = http_stream(server.http_url, {"text_input": prompt})
    assert got["status"] == 200 and "error" not in got, got
    assert (got["token_ids"], got["text"], got["finish_reason"]) == (want.token_ids, want.text, want.finish_reason)
    assert got["chunks"] > 2


def test_max_tokens_limits_the_answer(server, direct):
    got = http_stream(server.http_url, {"text_input": PROMPTS[0], "max_tokens": 3})
    assert got["token_ids"] == direct(PROMPTS[0]).token_ids[:3]
    assert got["finish_reason"] == "length"


def test_eight_concurrent_clients_get_their_own_complete_answers(server, direct):
    wants = {p: direct(p) for p in PROMPTS}

    def client(i: int) -> tuple[str, dict]:
        prompt = PROMPTS[i]
        if i % 2:
            return prompt, http_stream(server.http_url, {"text_input": prompt})
        return prompt, grpc_stream(server.grpc_url, prompt)

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(client, range(8)))
    for prompt, got in results:
        want = wants[prompt]
        assert got.get("error") is None, (prompt, got)
        assert got["token_ids"] == want.token_ids, prompt
        assert got["text"] == want.text, prompt
        assert got["finish_reason"] == want.finish_reason


@pytest.mark.parametrize("params, match", [
    ({"temperature": -1.0}, "temperature"),
    ({"top_p": 2.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_k": -3}, "top_k"),
])
def test_invalid_parameters_get_an_error_response_over_grpc(server, params, match):
    got = grpc_stream(server.grpc_url, "hi", **params)
    assert "error" in got and match in got["error"] and "fix:" in got["error"], got


def test_invalid_parameters_get_an_error_response_over_http(server):
    got = http_stream(server.http_url, {"text_input": "hi", "repetition_penalty": -1})
    assert got["status"] == 400 and "repetition_penalty" in got["error"], got
    got = http_stream(server.http_url, {"text_input": "x " * 9000})  # longer than the model's context
    assert "does not fit the model's context" in got.get("error", ""), got
    got = grpc_stream(server.grpc_url, None)  # no prompt at all: Triton itself refuses
    assert "text_input" in got.get("error", ""), got


def test_model_still_serves_after_errors(server, direct):
    got = grpc_stream(server.grpc_url, PROMPTS[3])
    assert got.get("token_ids") == direct(PROMPTS[3]).token_ids
    assert server.proc.poll() is None
    assert "Stub process" not in server.log_tail(20000) or "unhealthy" not in server.log_tail(20000)


def test_stop_by_pid_leaves_nothing_behind(server):
    pid = server.proc.pid
    left = server.stop()
    assert server.proc.returncode is not None
    assert left == [], f"tritonserver (pid {pid}) left {left}"
    assert not Path(f"/proc/{pid}").exists()
