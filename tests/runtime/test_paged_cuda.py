"""The CUDA paged engine (runtime/engines/paged_cuda.py) under the ContinuousBatcher (runtime/decoding/batching.py).

CPU (here and in CI): the engine runs the paged-GQA graph through the ORT ops' CPU kernels, no CUDA
graphs. Batched greedy outputs equal each request run alone (the same engine, one request at a time);
a seeded sampled request draws the same tokens whatever it is batched with; random load with
cancellations and preemption gives every page back (sync and async scheduling); `run`'s generate path
goes through the batcher. Async scheduling is the CUDA engine's default (through `launch`, no thread;
ES_ASYNC_STEPS=0 or SchedulerConfig(async_steps=False) turns it off); here the batched runs are async
(steps in the scheduler's worker thread), the GPU tests run both.
GPU (marked gpu, run on the device machine): 32 mixed-length requests batched equal each alone in
batch-invariant mode (decode steps through the CUDA-graph buckets, chunked prefill beside decodes); 2,000 random requests finish
with every page back in the pool; the pool is sized from free GPU memory.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from helpers.external import needs_cuda
from helpers.paged_engine import gpu, monkeypatch_module, paged_dir  # noqa: F401  (fixtures, the marker)

from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.decoding.sampling import SamplingParams

CAPACITY = 256
VOCAB = 49152  # tiny:llama-hd64's vocabulary (the SmolLM2 tokenizer)


def _engine(paged_dir, device="cpu", num_pages=48, max_batch=8):
    from enginesmith.runtime.engines.paged_cuda import open_paged_engine

    return open_paged_engine(paged_dir, device=device, max_batch=max_batch, num_pages=num_pages).engine


def _alone(engine, prompt, budget, sampling=None, stop=()) -> list[int]:
    batcher = ContinuousBatcher(engine, SchedulerConfig(max_batch=1, max_tokens=64, chunk=16),
                                enable_prefix_caching=False)
    rid = batcher.add_request(prompt, budget, stop, sampling)
    batcher.run()
    return batcher.finished[rid].output


def _run_checked(batcher: ContinuousBatcher, cancel_at: dict | None = None) -> list:
    steps = []
    while batcher.has_unfinished:
        for rid in (cancel_at or {}).pop(len(steps), []):
            batcher.cancel(rid)
        steps.append(batcher.step())
        batcher.manager.check_invariants()
    assert batcher.manager.seqs == {} and batcher.manager.num_free_blocks == batcher.model.num_pages - 1
    return steps


def _batched_equals_alone(engine, n: int, seed: int, max_batch: int, max_tokens: int,
                          async_steps: bool | None = None) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 90, n)
    budgets = rng.integers(1, 40, n)
    prompts = [rng.integers(0, VOCAB, int(k)).tolist() for k in lengths]
    batcher = ContinuousBatcher(engine, SchedulerConfig(max_batch=max_batch, max_tokens=max_tokens, chunk=16,
                                                        async_steps=async_steps))
    ids = [batcher.add_request(p, int(b)) for p, b in zip(prompts, budgets)]
    steps = _run_checked(batcher)
    assert max(len(s.scheduled) for s in steps) == max_batch
    assert any(s.width > 1 and len(s.new_tokens) > 0 for s in steps)  # prompt chunks beside decodes
    assert any(s.width == 1 for s in steps)                            # decode-only steps (graph buckets on CUDA)
    differ = [rid for rid, p, b in zip(ids, prompts, budgets) if batcher.finished[rid].output != _alone(engine, p, int(b))]
    assert differ == [], f"{len(differ)} of {n} requests differ from the request run alone"


# ----------------------------------------------------------------------------- CPU (CI)

@pytest.mark.parametrize("invariant", [False, True])
def test_batched_greedy_equals_each_request_alone_cpu(paged_dir, invariant):
    """invariant: the scheduler's batch-invariant grouping (single-token rows apart from chunks), which
    ES_BATCH_INVARIANT=1 turns on for the CUDA engine, keeps the outputs too."""
    engine = _engine(paged_dir)
    engine.batch_invariant = invariant
    _batched_equals_alone(engine, n=8, seed=0, max_batch=4, max_tokens=40, async_steps=True)  # alone: sync


def test_seeded_sampling_does_not_depend_on_batch_mates(paged_dir):
    engine = _engine(paged_dir)
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234)
    prompt = list(range(100, 130))
    alone = _alone(engine, prompt, 12, params)
    batcher = ContinuousBatcher(engine, SchedulerConfig(max_batch=4, max_tokens=40, chunk=16, async_steps=True))
    rid = batcher.add_request(prompt, 12, sampling=params)
    for k in range(3):
        batcher.add_request(list(range(7 * k, 7 * k + 20)), 9, sampling=SamplingParams(temperature=1.0, seed=k))
    _run_checked(batcher)
    assert batcher.finished[rid].output == alone
    other = _alone(engine, prompt, 12, SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=99))
    assert other != alone  # the seed matters (a different draw, not a constant)


@pytest.mark.parametrize("async_steps", [False, True])
def test_random_load_with_cancellation_and_preemption_leaks_no_page(paged_dir, async_steps):
    engine = _engine(paged_dir, num_pages=12)  # 11 usable pages of 16: preemption under this load
    rng = np.random.default_rng(5)
    # reserve_new_tokens=1: admission reserves no output pages, so the load still preempts (admission by the
    # whole request's pages, the default, avoids it: tests/runtime/test_batching.py)
    batcher = ContinuousBatcher(engine, SchedulerConfig(max_batch=6, max_tokens=48, chunk=16, async_steps=async_steps,
                                                        reserve_new_tokens=1))
    ids = []
    for i in range(30):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 70))).tolist()
        params = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), seed=i)
        stop = [int(rng.integers(0, VOCAB))] if i % 5 == 0 else []
        ids.append(batcher.add_request(prompt, int(rng.integers(1, 30)), stop, params))
    cancel = {3: [ids[0], ids[7]], 10: [ids[12]], 25: [ids[20], "unknown"]}
    steps = _run_checked(batcher, cancel)
    reasons = {batcher.finished[r].finish_reason for r in ids}
    assert len(batcher.finished) == 30 and "cancelled" in reasons and "length" in reasons
    assert sum(len(s.preempted) for s in steps) >= 1
    assert max(s.pages_used for s in steps) > 8


def test_generate_runs_through_the_batcher(paged_dir):
    """`enginesmith run` on a paged engine: runtime.decoding.generate drives the batcher (lockstep rows)."""
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids

    engine = _engine(paged_dir)
    prompts = [[5, 6, 7], list(range(40, 75))]
    got = [[], []]
    for ids, finished in generate_ids(engine, prompts, GenerationConfig(max_new_tokens=10)):
        for r in range(2):
            if not finished[r]:
                got[r].append(int(ids[r]))
    assert got == [_alone(engine, p, 10) for p in prompts]


# ----------------------------------------------------------------------------- GPU

INVARIANT_CHILD = "ENGINESMITH_TEST_INVARIANT_CHILD"


@gpu
@needs_cuda
def test_gpu_32_mixed_requests_batched_equal_each_alone(paged_dir):
    """In a process with ES_BATCH_INVARIANT=1 (the ops read it once per process): the default mode lets
    cuBLAS pick kernels by row count, so a request's greedy tokens may differ batched (2 of 32 did on an
    H100); the invariant mode is what promises equality."""
    import subprocess
    import sys

    env = dict(os.environ, ES_BATCH_INVARIANT="1", **{INVARIANT_CHILD: "1"})
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                            f"{__file__}::test_gpu_identity_in_an_invariant_process"],
                           env=env, capture_output=True, text=True, timeout=900)
    assert child.returncode == 0 and re.search(r"\b1 passed", child.stdout), child.stdout[-4000:] + child.stderr[-2000:]


@gpu
@needs_cuda
@pytest.mark.skipif(os.environ.get(INVARIANT_CHILD) != "1",
                    reason="runs in the child process of test_gpu_32_mixed_requests_batched_equal_each_alone")
def test_gpu_identity_in_an_invariant_process(paged_dir):
    engine = _engine(paged_dir, device="cuda", num_pages=512, max_batch=32)
    assert engine.batch_invariant
    _batched_equals_alone(engine, n=32, seed=1, max_batch=32, max_tokens=512)
    _batched_equals_alone(engine, n=32, seed=1, max_batch=32, max_tokens=512, async_steps=True)
    assert engine._buckets and any(b.graph is not None for b in engine._buckets.values())


@gpu
@needs_cuda
@pytest.mark.parametrize("async_steps", [False, True])
def test_gpu_2000_random_requests_give_every_page_back(paged_dir, async_steps):
    engine = _engine(paged_dir, device="cuda", num_pages=160, max_batch=8)
    rng = np.random.default_rng(7)
    batcher = ContinuousBatcher(engine, SchedulerConfig(max_batch=8, max_tokens=128, chunk=16,
                                                        async_steps=async_steps))
    for i in range(2000):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 120))).tolist()
        batcher.add_request(prompt, int(rng.integers(1, 12)),
                            sampling=SamplingParams(temperature=float(rng.choice([0.0, 1.0])), seed=i))
        if i % 37 == 0:
            batcher.cancel(f"req{i // 2}")
    steps = _run_checked(batcher)
    assert len(batcher.finished) == 2000
    assert max(s.pages_used for s in steps) > 30


@gpu
@needs_cuda
def test_gpu_pool_is_sized_from_free_memory(paged_dir):
    """The pool takes the utilization share of the whole GPU less what is in use (by any process): asked for
    what is in use now and 8 GiB more, it takes about 8 GiB, whatever the other test processes hold (a
    share of 0.9 beside them went negative: "-53885 pages" on an H200), then gives it back."""
    import gc

    import torch

    from enginesmith.runtime.engines.paged_cuda import SLACK_BYTES, open_paged_engine

    free, total = torch.cuda.mem_get_info()
    share = min(0.95, (total - free + (8 << 30)) / total)
    engine = open_paged_engine(paged_dir, device="cuda", max_batch=8, gpu_memory_utilization=share).engine
    try:
        assert engine.num_pages > 1000
        assert (2 << 30) < engine.nbytes() < (8 << 30) + SLACK_BYTES, engine.nbytes() / (1 << 30)
    finally:
        del engine
        gc.collect()
        torch.cuda.empty_cache()


@gpu
@needs_cuda
def test_gpu_plain_steps_called_from_another_stream_wait_for_the_engine(paged_dir):
    """`_plain` from torch's default stream while the engine's stream is busy (a 50 ms sleep queued on it):
    the logits the caller reads are the step's. Before the fix the copies went to the caller's stream and
    the caller read the logits before ONNX Runtime had run (gemma3-fp16's paged test, H200, session 18)."""
    import torch

    engine = _engine(paged_dir, device="cuda", num_pages=16, max_batch=2)
    ids = np.array([[5, 6, 7, 8]])
    tables = np.zeros((1, engine.max_blocks), np.int32)
    tables[0, :2] = [1, 2]
    context = np.array([4], np.int32)
    slots = (tables[0, np.arange(4) // engine.page_size] * engine.page_size + np.arange(4) % engine.page_size)
    slots = slots[None].astype(np.int32)
    with engine._on_stream():
        want = engine._plain(engine.kv, ids, tables, context, slots).float().cpu().numpy()
    engine.stream.synchronize()
    with torch.cuda.stream(engine.stream):
        torch.cuda._sleep(50_000_000)  # ~50 ms of GPU cycles ahead of the step on the engine's stream
    got = engine._plain(engine.kv, ids, tables, context, slots).float().cpu().numpy()  # the default stream
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3)
