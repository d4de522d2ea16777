"""A real tritonserver (nvidia-pytriton 0.7.0, Triton 2.51, CPU) serving a tiny paged engine: every
request goes through the model's one scheduler loop.

50 concurrent gRPC streams each get the greedy tokens of their request run alone, and all 50 end well
before 50 times one request; a client that cancels its stream has its request cancelled in the loop;
SIGTERM with streams open stops the server gracefully (exit 0) and leaves nothing behind.
The tests in this module run in order and share one server.
"""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from helpers.external import missing, needs_cuda, require_module  # noqa: E402
from triton_server import GrpcStream, TritonServer, grpc_stream, model_env, pytriton_root  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "tiny_paged"
STREAMS = 50
MAX_TOKENS = 32
PROMPTS = [f"Request {i}: tell me about the number {i * 7}." for i in range(STREAMS)]


@pytest.fixture(scope="module")
def alone(paged_engine):
    """Greedy token ids of each prompt run by itself (a batch of one), in-process: the oracle."""
    from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
    from enginesmith.runtime.text.chat import encode_prompt, stop_token_ids
    from enginesmith.runtime.load import open_engine, paged_model

    loaded = open_engine(paged_engine, device="cpu", verify_hashes=False)
    stops = stop_token_ids(loaded.tokenizer, loaded.manifest)
    out = {}
    for prompt in PROMPTS:
        batcher = ContinuousBatcher(paged_model(loaded, 64), SchedulerConfig(max_batch=1))
        rid = batcher.add_request(encode_prompt(loaded.tokenizer, prompt), MAX_TOKENS, stops)
        batcher.run()
        out[prompt] = batcher.finished[rid].output
    return out


@pytest.fixture(scope="module")
def server(paged_engine, tmp_path_factory):
    require_module("tritonclient.grpc", "pip install 'tritonclient[grpc,http]'")
    if pytriton_root() is None:
        missing("tritonserver is not installed", "pip install --no-deps nvidia-pytriton==0.7.0")
    from enginesmith.serving.triton_repository import write_model_repository

    work = tmp_path_factory.mktemp("triton-batched")
    write_model_repository(paged_engine, work / "repo", MODEL, execution_env=model_env(), device="cpu",
                           max_tokens=MAX_TOKENS, max_batch=8, threads=1)
    srv = TritonServer(work / "repo", work)
    try:
        srv.start([MODEL])
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


def test_fifty_concurrent_streams_get_their_own_tokens_well_before_fifty_times_one(server, alone):
    assert "with one scheduler loop" in server.log_tail(100_000)
    single = GrpcStream(server.grpc_url)
    try:
        single.infer(MODEL, PROMPTS[0])  # warm-up
        begun = time.perf_counter()
        for prompt in PROMPTS:  # the 50 requests one after the other: 50 x one request
            assert single.infer(MODEL, prompt).get("token_ids") == alone[prompt], prompt
        one_by_one = time.perf_counter() - begun
    finally:
        single.close()
    streams = [GrpcStream(server.grpc_url) for _ in range(STREAMS)]  # opened before the clock starts
    barrier = threading.Barrier(STREAMS)

    def client(i: int) -> dict:
        barrier.wait(60)
        return streams[i].infer(MODEL, PROMPTS[i], timeout=120)

    try:
        begun = time.perf_counter()
        with ThreadPoolExecutor(max_workers=STREAMS) as pool:
            results = list(pool.map(client, range(STREAMS)))
        together = time.perf_counter() - begun
    finally:
        for stream in streams:
            stream.close()
    for prompt, got in zip(PROMPTS, results):
        assert got.get("error") is None, (prompt, got)
        assert got["token_ids"] == alone[prompt], prompt
        assert got["chunks"] >= 2  # streamed, not one blob
    print(f"\n{STREAMS} concurrent streams: {together:.2f} s; the same requests one at a time: {one_by_one:.2f} s")
    assert together < 0.5 * one_by_one, f"{STREAMS} streams took {together:.2f} s; one at a time {one_by_one:.2f} s"


def test_a_client_cancel_cancels_the_request_in_the_loop(server):
    """One of eight long streams cancels after its first response: the model ends it (an empty final
    response, a log line) and frees its pages; the other seven run to their end."""
    def long_stream(seed: int) -> dict:
        return grpc_stream(server.grpc_url, MODEL, "Write a long story.", max_tokens=440, temperature=1.0, seed=seed,
                           raw=True, timeout=120)

    before = server.log_tail(1_000_000).count("cancelled by the client")
    with ThreadPoolExecutor(max_workers=7) as pool:
        others = [pool.submit(long_stream, seed) for seed in range(10, 17)]
        got = grpc_stream(server.grpc_url, MODEL, "Write a long story.", cancel_after=1, max_tokens=440,
                          temperature=1.0, seed=3, raw=True)
        assert got.get("cancelled"), got
        deadline = time.monotonic() + 10
        while server.log_tail(1_000_000).count("cancelled by the client") == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.log_tail(1_000_000).count("cancelled by the client") == before + 1, server.log_tail(3000)
        assert all(f.result().get("finish_reason") == "length" for f in others)  # the others ran to the end
    got = grpc_stream(server.grpc_url, MODEL, PROMPTS[1])  # still serving
    assert got.get("finish_reason") in ("stop", "length"), got


def test_an_engine_core_process_serves_streams_as_alone_and_an_unload_stops_it(paged_engine, alone, tmp_path):
    """`enginesmith triton --engine-core process`: the model's stub starts the scheduler loop in an engine
    core process of its own (serving/engine_core.py, as `serve` does on a GPU); 8 concurrent streams get
    what each gets alone; an unload stops the core (no process left), and the server serves on."""
    from enginesmith.serving.triton_repository import write_model_repository

    write_model_repository(paged_engine, tmp_path / "repo", MODEL, execution_env=model_env(), device="cpu",
                           max_tokens=MAX_TOKENS, max_batch=8, threads=1, engine_core="process")
    srv = TritonServer(tmp_path / "repo", tmp_path)
    try:
        srv.start([MODEL])
        found = re.search(r"an engine core process \(pid (\d+); 8 rows per step", srv.log_tail(100_000))
        assert found, srv.log_tail(3000)
        core = int(found.group(1))
        assert Path(f"/proc/{core}").exists()
        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(lambda prompt: grpc_stream(srv.grpc_url, MODEL, prompt), PROMPTS[:8]))
        assert [r.get("token_ids") for r in results] == [alone[p] for p in PROMPTS[:8]], results
        request = urllib.request.Request(f"http://{srv.http_url}/v2/repository/models/{MODEL}/unload", data=b"{}",
                                         method="POST", headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            assert response.status == 200
        deadline = time.monotonic() + 30
        while Path(f"/proc/{core}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{core}").exists(), f"the engine core (pid {core}) outlived the unload"
        assert srv.proc.poll() is None
    finally:
        left = srv.stop()
    assert left == [], left


@pytest.mark.skip(reason="tritonserver 2.51 hangs at SIGTERM about 1 run in 6 with open streams (seen with the old "
                         "worker model too: nothing the model sends reaches the server after the signal); "
                         "test_triton_server.py keeps one SIGTERM test; drop this mark to run it by hand")
def test_sigterm_with_streams_open_stops_gracefully(server):
    started = threading.Event()
    results: list[dict] = []

    def long_stream(seed: int) -> None:
        results.append(grpc_stream(server.grpc_url, MODEL, "Write a long story.", on_chunk=started.set,
                                   max_tokens=440, temperature=1.0, seed=seed, raw=True, timeout=60))

    threads = [threading.Thread(target=long_stream, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    assert started.wait(60)
    pid = server.proc.pid
    begun = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    status = server.proc.wait(timeout=30)
    took = time.monotonic() - begun
    for t in threads:
        t.join(30)
    left = server.stop()
    log = server.log_tail(100_000)
    assert "Exit timeout expired" not in log, log[-3000:]
    assert status == 0 and took < 5, f"exit {status} after {took:.1f} s:\n{log[-3000:]}"
    assert len(results) == 4 and all("error" in r or r.get("finish_reason") for r in results), results
    assert left == [], f"tritonserver (pid {pid}) left {left}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_paged_engine_on_a_gpu_instance_serves_concurrent_streams_as_alone(ort_ops_lib, tmp_path, monkeypatch):
    """A --for-cuda --kv paged engine in a real tritonserver, one KIND_GPU instance (`gpus=(0,)`): the
    instance pins itself to its GPU, and 24 concurrent streams get what each gets alone (greedy, fp16:
    the batch-invariant steps)."""
    require_module("tritonclient.grpc", "pip install 'tritonclient[grpc,http]'")
    if pytriton_root() is None:
        missing("tritonserver is not installed", "pip install --no-deps nvidia-pytriton==0.7.0")
    from enginesmith.builder.engine import BuildConfig, build, cached_engine
    from enginesmith.serving.triton_repository import parse_config, write_model_repository

    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))  # the stub inherits the server's environment
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    engine = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=256, kv_layout="paged", page_size=16,
                               max_batch=32), tmp_path / "engine", source=src, progress=False)
    model = write_model_repository(engine, tmp_path / "repo", MODEL, execution_env=model_env(), device="cuda",
                                   max_tokens=32, gpus=(0,))
    assert [list(g.gpus) for g in parse_config((model / "config.pbtxt").read_text()).instance_group] == [[0]]
    srv = TritonServer(tmp_path / "repo", tmp_path)
    try:
        srv.start([MODEL])
        assert "on GPU 0 with one scheduler loop" in srv.log_tail(100_000), srv.log_tail(3000)
        alone = [grpc_stream(srv.grpc_url, MODEL, p).get("token_ids") for p in PROMPTS[:24]]
        assert all(alone), alone
        streams = [GrpcStream(srv.grpc_url) for _ in range(24)]
        try:
            with ThreadPoolExecutor(max_workers=24) as pool:
                results = list(pool.map(lambda i: streams[i].infer(MODEL, PROMPTS[i], timeout=120), range(24)))
        finally:
            for stream in streams:
                stream.close()
        assert [r.get("token_ids") for r in results] == alone
    finally:
        left = srv.stop()
    assert left == [] and "Traceback" not in srv.log_tail(1_000_000)
