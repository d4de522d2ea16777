"""Continuous batching over a paged engine (runtime/decoding/batching.py) on ORT CPU: requests of different
lengths join and leave the batch every step, prompts are prefilled in chunks next to decode rows,
shared prompt prefixes are taken from the prefix cache, a small pool forces preemption; every
request's greedy output equals the request run alone (dense engine, runtime.decoding.generate), with sync and
async scheduling (one step in flight while the next is scheduled). Async scheduling under random load
(stop tokens and strings, cancellations, preemption in a tiny pool, seeded sampling) gives the sync
scheduler's tokens and every page back; a fake model's timeline shows the host work beside its steps."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids
from enginesmith.runtime.engines.ort_paged_model import OrtPagedModel
from enginesmith.runtime.engines.ort_engine import OrtEngine
from enginesmith.runtime.decoding.sampling import SamplingParams
from helpers.paged_graphs import paged  # noqa: F401  (the fixture: dense and paged graphs, built once)

VOCAB = 49152


@pytest.fixture(scope="module")
def engines(paged):  # noqa: F811  (the imported fixture)
    """engines(family, page_size) -> (dense OrtEngine, paged OrtEngine)."""
    made: dict = {}

    def get(family: str, page_size: int):
        if (family, page_size) not in made:
            dense, out, _ = paged(family, page_size)
            made[family, page_size] = (OrtEngine(dense, device="cpu", threads=1),
                                       OrtEngine(out, device="cpu", threads=1))
        return made[family, page_size]

    return get


def alone(dense, prompt, max_new_tokens, stop=()) -> list[int]:
    config = GenerationConfig(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop))
    out = []
    for ids, finished in generate_ids(dense, [prompt], config):
        if finished[0]:
            break
        out.append(int(ids[0]))
    return out


def run_checked(batcher: ContinuousBatcher) -> list:
    """Step to the end, checking the block manager's invariants after every step."""
    steps = []
    while batcher.has_unfinished:
        steps.append(batcher.step())
        batcher.manager.check_invariants()
    assert batcher.manager.seqs == {} and batcher.manager.num_free_blocks == batcher.model.num_pages - 1
    return steps


@pytest.mark.parametrize("family,page_size,async_steps", [("llama", 4, False), ("qwen2", 16, False),
                                                         ("llama", 4, True), ("qwen2", 16, True)])
def test_batched_output_equals_each_request_alone(family, page_size, async_steps, engines):
    dense, paged_engine = engines(family, page_size)
    rng = np.random.default_rng(0)
    lengths, budgets = (1, 30, 7, 19, 3, 12, 25), (9, 4, 14, 6, 11, 8, 5)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 64),
                                config=SchedulerConfig(max_batch=3, max_tokens=16, chunk=8, async_steps=async_steps))
    ids = [batcher.add_request(p, m) for p, m in zip(prompts, budgets)]
    steps = run_checked(batcher)
    for rid, prompt, budget in zip(ids, prompts, budgets):
        assert batcher.finished[rid].output == alone(dense, prompt, budget), rid
        assert batcher.finished[rid].finish_reason == "length"
    # The batch really changed: rows joined and left, chunked prefills ran next to decode rows.
    compositions = {s.scheduled for s in steps}
    assert len(compositions) > 5 and max(len(s.scheduled) for s in steps) == 3
    assert any(len(s.new_tokens) and s.num_tokens > len(s.scheduled) for s in steps)
    assert len(steps) < sum(budgets)  # fewer steps than running the requests one after another


@pytest.mark.parametrize("async_steps", [False, True])
def test_prefix_sharing_and_preemption_keep_outputs_exact(async_steps, engines):
    dense, paged_engine = engines("llama", 4)
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 13).tolist()             # 3 full pages of 4 shared
    prompts = [system + rng.integers(0, VOCAB, n).tolist() for n in (2, 5, 1, 9)] + [rng.integers(0, VOCAB, 6).tolist()]
    budgets = [12, 10, 14, 9, 12]
    # 12 usable pages of 4 tokens: not enough for everything at once; one output token reserved at admission,
    # so requests grow past their reservation -> preemption (recompute).
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 13),
                                config=SchedulerConfig(max_batch=4, max_tokens=32, chunk=32, async_steps=async_steps,
                                                       reserve_new_tokens=1))
    ids = [batcher.add_request(p, m) for p, m in zip(prompts, budgets)]
    steps = run_checked(batcher)
    requests = [batcher.finished[r] for r in ids]
    for req, prompt, budget in zip(requests, prompts, budgets):
        assert req.output == alone(dense, prompt, budget), req.request_id
    assert sum(r.prefix_hit_tokens >= 12 for r in requests[1:4]) >= 2   # the system prompt was shared
    assert sum(len(s.preempted) for s in steps) >= 1 and any(r.preemptions for r in requests)


@pytest.mark.parametrize("async_steps", [False, True])
def test_stop_tokens_finish_a_request_early(async_steps, engines):
    dense, paged_engine = engines("llama", 4)
    prompt = [7, 8, 9, 10, 11]
    reference = alone(dense, prompt, 8)
    stop = reference[3]
    cut = reference.index(stop)
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 16), SchedulerConfig(async_steps=async_steps))
    rid = batcher.add_request(prompt, 8, stop_token_ids=[stop])
    other = batcher.add_request([1, 2, 3], 6)
    run_checked(batcher)
    assert batcher.finished[rid].output == reference[:cut + 1] and batcher.finished[rid].finish_reason == "stop"
    assert batcher.finished[other].output == alone(dense, [1, 2, 3], 6)


def test_bad_requests_and_settings_are_refused(engines):
    dense, paged_engine = engines("llama", 4)
    with pytest.raises(UserError, match="no paged KV layout"):
        ContinuousBatcher(OrtPagedModel(dense, 16))
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 4))
    with pytest.raises(UserError, match="empty prompt"):
        batcher.add_request([], 4)
    with pytest.raises(UserError, match="needs 5 pages; the pool has 3"):
        batcher.add_request(list(range(10)), 10)
    with pytest.raises(UserError, match="max_new_tokens"):
        batcher.add_request([1], 0)
    with pytest.raises(UserError, match="chunk=0"):
        SchedulerConfig(chunk=0)


def letters(ids) -> str:
    """A stand-in tokenizer for stop strings: token t is one letter."""
    return "".join(chr(97 + int(t) % 26) for t in ids)


def random_load(model, async_steps: bool, cancel_at: dict) -> tuple[ContinuousBatcher, list[str], list]:
    rng = np.random.default_rng(3)
    # one output token reserved at admission: requests outgrow the pool, so preemption runs under async steps too
    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=5, max_tokens=24, chunk=8, async_steps=async_steps,
                                                       reserve_new_tokens=1), decode=letters)
    ids = []
    for i in range(24):
        prompt = rng.integers(0, VOCAB, int(rng.integers(1, 20))).tolist()
        sampling = SamplingParams(temperature=float(rng.choice([0.0, 0.9])), seed=i)
        stop = rng.integers(0, VOCAB, 8000).tolist() if i % 4 == 0 else []  # 1 in 6 tokens stops
        strings = (letters(rng.integers(0, 26, 1)),) if i % 3 == 0 else ()  # 1 in 26 tokens stops
        ids.append(batcher.add_request(prompt, int(rng.integers(1, 16)), stop, sampling, stop_strings=strings))
    pending = {k: list(v) for k, v in cancel_at.items()}
    steps = []
    while batcher.has_unfinished:
        for rid in pending.pop(len(steps), []):
            batcher.cancel(rid)
        steps.append(batcher.step())
        batcher.manager.check_invariants()
    assert batcher.manager.seqs == {} and batcher.pages_used == 0  # every page back in the pool
    batcher.close()
    return batcher, ids, steps


def test_async_steps_under_random_load_give_the_sync_tokens_and_every_page_back(engines):
    """Stop tokens and strings, cancellations, seeded sampling and preemption (11 pages of 4 for up to 5
    rows): each request's tokens equal the sync scheduler's (a cancelled one's: a prefix of them)."""
    _, paged_engine = engines("llama", 4)
    cancel_at = {2: ["req1", "req9"], 6: ["req14"], 9: ["req20", "unknown"]}
    sync, ids, _ = random_load(OrtPagedModel(paged_engine, 12), False, {})
    run, _, steps = random_load(OrtPagedModel(paged_engine, 12), True, cancel_at)
    reasons = {run.finished[r].finish_reason for r in ids}
    assert {"stop", "length", "cancelled"} <= reasons
    assert any(isinstance(run.finished[r].stop_reason, str) for r in ids)  # a stop string ended one
    assert sum(len(s.preempted) for s in steps) >= 1
    for rid in ids:
        got, want = run.finished[rid], sync.finished[rid]
        if got.finish_reason == "cancelled":
            assert got.output == want.output[:len(got.output)], rid
        else:
            assert (got.output, got.finish_reason, got.stop_reason) == \
                (want.output, want.finish_reason, want.stop_reason), rid
    # the StepOutput contract: every token is reported once, by the step that computed it
    reported: dict[str, list[int]] = {}
    for s in steps:
        for rid, token in s.new_tokens.items():
            reported.setdefault(rid, []).append(token)
    assert all(reported.get(rid, []) == run.finished[rid].output for rid in ids)


class SleepyModel:
    """A PagedModel whose step is a GIL-free sleep (as a device step is); it records when each ran."""

    num_pages, page_size, max_chunk, max_positions = 1024, 16, None, None

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.runs: list[tuple[float, float]] = []

    def copy_pages(self, copies) -> None:
        pass

    def run(self, ids, step, picks) -> list[int]:
        t0 = time.perf_counter()
        time.sleep(self.step_s)
        self.runs.append((t0, time.perf_counter()))
        return [1000 + p.index for p in picks]


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:  # holds the GIL, as the scheduler's Python does
        pass


def timeline(async_steps: bool, host_s: float = 0.01, step_s: float = 0.02) -> tuple[float, SleepyModel, list]:
    model = SleepyModel(step_s)
    host: list[tuple[float, float]] = []

    def slow_decode(ids) -> str:  # the host's token processing (a stop-string check), made slow
        t0 = time.perf_counter()
        busy(host_s)
        host.append((t0, time.perf_counter()))
        return ""

    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=4, async_steps=async_steps), decode=slow_decode)
    rid = batcher.add_request([1, 2, 3], 12, stop_strings=("never",))
    start = time.perf_counter()
    batcher.run()
    wall = time.perf_counter() - start
    batcher.close()
    assert batcher.finished[rid].output == [1000 + i for i in range(12)]
    return wall, model, host


def test_async_steps_run_the_host_work_beside_the_model_step():
    sync_wall, sync_model, sync_host = timeline(False)
    wall, model, host = timeline(True)
    assert threading.active_count() < 50  # the worker threads ended with close()

    def inside(t, runs):
        return any(a <= t <= b for a, b in runs)

    # sync: token processing never runs while the model runs; async: nearly always (not the last step's)
    assert not any(inside((a + b) / 2, sync_model.runs) for a, b in sync_host)
    assert sum(inside((a + b) / 2, model.runs) for a, b in host) >= len(host) - 2
    assert len(model.runs) == len(sync_model.runs) == 12
    assert wall < 0.9 * sync_wall, (wall, sync_wall)  # ~ max(host, step) per step, not their sum


def test_close_takes_the_step_in_flight_and_stepping_may_go_on():
    batcher = ContinuousBatcher(SleepyModel(0.0), SchedulerConfig(max_batch=2, async_steps=True))
    ids = [batcher.add_request([1, 2, 3], 6) for _ in range(3)]
    for _ in range(3):
        batcher.step()
    batcher.close()  # the speculative step's tokens are appended and checked, not lost
    assert sum(len(batcher.request(r).output) for r in ids) == 8  # 4 steps of 2 rows
    batcher.run()
    batcher.close()
    assert [batcher.finished[r].output for r in ids] == [[1000 + i for i in range(6)]] * 3
    assert batcher.pages_used == 0 and not batcher.has_unfinished


def _closed_loop_run(model, requests, concurrency: int, config: SchedulerConfig) -> dict:
    """measure.throughput.run_offline (no warm-up, no bandwidth bound), plus the tokens computed (recomputed
    ones included) over all steps."""
    from enginesmith.measure.throughput import run_offline

    computed = []
    result = run_offline(model, requests, concurrency, config, warmup=0, bandwidth_gbs=1.0, weight_bytes=1,
                         kv_bytes_per_token=1, on_step=lambda out: computed.append(out.num_tokens))
    return {**result, "computed": sum(computed)}


def test_admission_by_needed_pages_never_thrashes_and_concurrency_wins(engines):
    """A pool far smaller than 8 requests' prompts and outputs (as the default CPU pool is for the Austen
    workload): concurrency 8 admits only what it can finish, so no request is preempted, nothing is computed
    twice, steps hold several rows, and it beats concurrency 1. Admission by the first chunk's pages (one
    output token reserved) preempts and recomputes on the same workload: the check can fail."""
    from enginesmith.measure.throughput import BenchRequest

    _, paged_engine = engines("llama", 4)
    rng = np.random.default_rng(7)
    requests = [BenchRequest(tuple(rng.integers(0, VOCAB, int(rng.integers(8, 31))).tolist()),
                             int(rng.integers(4, 25))) for _ in range(16)]
    work = sum(len(r.prompt) + r.new_tokens - 1 for r in requests)  # tokens each request computes once
    model = OrtPagedModel(paged_engine, 40)  # 39 pages of 4 tokens: 156 tokens; a request needs up to 14 pages
    config = lambda c, reserve=1024: SchedulerConfig(max_batch=c, max_tokens=256, chunk=32,  # noqa: E731
                                                     reserve_new_tokens=reserve)
    one = _closed_loop_run(model, requests, 1, config(1))
    eight = _closed_loop_run(model, requests, 8, config(8))
    assert one["preemptions"] == eight["preemptions"] == 0
    assert one["computed"] == eight["computed"] == work
    assert eight["steps"] < 0.6 * one["steps"] and eight["max_batch"] >= 3
    assert eight["tok_s"] > one["tok_s"]
    assert eight["leaked_pages"] == 0
    greedy = _closed_loop_run(model, requests, 8, config(8, reserve=1))
    assert greedy["preemptions"] > 0 and greedy["computed"] > work
