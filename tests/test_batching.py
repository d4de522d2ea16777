"""Continuous batching over a paged engine (runtime/batching.py) on ORT CPU: requests of different
lengths join and leave the batch every step, prompts are prefilled in chunks next to decode rows,
shared prompt prefixes are taken from the prefix cache, a small pool forces preemption; every
request's greedy output equals the request run alone (dense engine, runtime.generate)."""

from __future__ import annotations

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.runtime.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.generate import GenerationConfig, generate_ids
from enginesmith.runtime.kv_paged import OrtPagedModel
from enginesmith.runtime.ort_engine import OrtEngine
from test_kv_paged import paged  # noqa: F401  (the fixture: dense and paged graphs, built once)

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


@pytest.mark.parametrize("family,page_size", [("llama", 4), ("qwen2", 16)])
def test_batched_output_equals_each_request_alone(family, page_size, engines):
    dense, paged_engine = engines(family, page_size)
    rng = np.random.default_rng(0)
    lengths, budgets = (1, 30, 7, 19, 3, 12, 25), (9, 4, 14, 6, 11, 8, 5)
    prompts = [rng.integers(0, VOCAB, n).tolist() for n in lengths]
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 64), config=SchedulerConfig(max_batch=3, max_tokens=16, chunk=8))
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


def test_prefix_sharing_and_preemption_keep_outputs_exact(engines):
    dense, paged_engine = engines("llama", 4)
    rng = np.random.default_rng(1)
    system = rng.integers(0, VOCAB, 13).tolist()             # 3 full pages of 4 shared
    prompts = [system + rng.integers(0, VOCAB, n).tolist() for n in (2, 5, 1, 9)] + [rng.integers(0, VOCAB, 6).tolist()]
    budgets = [12, 10, 14, 9, 12]
    # 12 usable pages of 4 tokens: not enough for everything at once -> preemption (recompute).
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 13), config=SchedulerConfig(max_batch=4, max_tokens=32, chunk=32))
    ids = [batcher.add_request(p, m) for p, m in zip(prompts, budgets)]
    steps = run_checked(batcher)
    requests = [batcher.finished[r] for r in ids]
    for req, prompt, budget in zip(requests, prompts, budgets):
        assert req.output == alone(dense, prompt, budget), req.request_id
    assert sum(r.prefix_hit_tokens >= 12 for r in requests[1:4]) >= 2   # the system prompt was shared
    assert sum(len(s.preempted) for s in steps) >= 1 and any(r.preemptions for r in requests)


def test_stop_tokens_finish_a_request_early(engines):
    dense, paged_engine = engines("llama", 4)
    prompt = [7, 8, 9, 10, 11]
    reference = alone(dense, prompt, 8)
    stop = reference[3]
    cut = reference.index(stop)
    batcher = ContinuousBatcher(OrtPagedModel(paged_engine, 16))
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
