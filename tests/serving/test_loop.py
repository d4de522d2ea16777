"""enginesmith/serving/loop.py: the one scheduler loop behind every front door, on a tiny paged CPU engine.

Requests submitted from many threads at once come back with the tokens each gets alone; a cancelled
request ends and its pages return (both with sync and async scheduling); beyond max_waiting, submit raises Overloaded; drain waits for the
requests in flight and then refuses new ones; an impossible request is refused in submit."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from helpers.paged_graphs import paged  # noqa: F401  (the fixture: dense and paged graphs, built once)

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.engines.ort_paged_model import OrtPagedModel
from enginesmith.runtime.engines.ort_engine import OrtEngine
from enginesmith.serving.loop import BatcherLoop, Draining, Overloaded

VOCAB = 49152


@pytest.fixture(scope="module")
def engine(paged):  # noqa: F811
    _, out, _ = paged("llama", 4)
    return OrtEngine(out, device="cpu", threads=1)


def collect(handle, timeout=60.0) -> tuple[list[int], tuple]:
    tokens = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = handle.events.get(timeout=timeout)
        if event[0] == "token":
            tokens.append(event[1])
        else:
            return tokens, event
    raise AssertionError("no end event")


def alone(engine, prompt, n) -> list[int]:
    b = ContinuousBatcher(OrtPagedModel(engine, 64), SchedulerConfig(max_batch=1))
    rid = b.add_request(prompt, n)
    b.run()
    return b.finished[rid].output


@pytest.mark.parametrize("async_steps", [False, True])
def test_threads_submitting_at_once_get_each_requests_own_tokens(engine, async_steps):
    loop = BatcherLoop(OrtPagedModel(engine, 96),
                       SchedulerConfig(max_batch=4, max_tokens=32, chunk=8, async_steps=async_steps))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(1, 20, 10)]
    results: dict[int, tuple] = {}

    def client(i):
        results[i] = collect(loop.submit(prompts[i], 6))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for i, p in enumerate(prompts):
            tokens, end = results[i]
            assert end == ("done", "length", None) and tokens == alone(engine, p, 6)
        stats = loop.stats()
        assert stats.requests_finished == 10 and stats.generated_tokens == 60 and stats.pages_used == 0
        ttft, itl = loop.take_observations()
        assert len(ttft) == 10 and len(itl) == 50 and min(ttft) > 0
    finally:
        loop.close()


@pytest.mark.parametrize("async_steps", [False, True])
def test_cancel_ends_a_request_and_returns_its_pages(engine, async_steps):
    loop = BatcherLoop(OrtPagedModel(engine, 64), SchedulerConfig(max_batch=2, async_steps=async_steps))
    try:
        handle = loop.submit(list(range(30)), 200)
        assert handle.events.get(timeout=60)[0] == "token"
        loop.cancel(handle.request_id)
        tokens, end = collect(handle)
        assert end == ("done", "cancelled", None) and len(tokens) < 199
        deadline = time.monotonic() + 10
        while loop.stats().pages_used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.stats().pages_used == 0 and loop.stats().requests_cancelled == 1
    finally:
        loop.close()


def test_overload_is_refused_not_queued_without_bound(engine):
    loop = BatcherLoop(OrtPagedModel(engine, 64), SchedulerConfig(max_batch=1), max_waiting=3)
    try:
        handles, refused = [], 0
        for _ in range(12):
            try:
                handles.append(loop.submit([1, 2, 3], 20))
            except Overloaded as exc:
                refused += 1
                assert exc.retry_after >= 1
        assert refused >= 1 and len(handles) <= 5
        for h in handles:
            assert collect(h)[1][0] == "done"
    finally:
        loop.close()


@pytest.mark.parametrize("async_steps", [False, True])
def test_drain_finishes_what_is_in_flight_then_refuses(engine, async_steps):
    loop = BatcherLoop(OrtPagedModel(engine, 64), SchedulerConfig(max_batch=2, async_steps=async_steps))
    try:
        handles = [loop.submit([5, 6, 7], 10) for _ in range(3)]
        assert loop.drain(timeout=120)
        for h in handles:
            tokens, end = collect(h, timeout=1)
            assert end[0] == "done" and len(tokens) == 10
        with pytest.raises(Draining):
            loop.submit([1], 1)
    finally:
        loop.close()


def test_impossible_requests_are_refused_in_submit(engine):
    loop = BatcherLoop(OrtPagedModel(engine, 8), SchedulerConfig(max_batch=2))
    try:
        with pytest.raises(UserError, match="empty prompt"):
            loop.submit([], 4)
        with pytest.raises(UserError, match="pages"):
            loop.submit(list(range(40)), 40)
        with pytest.raises(UserError, match="max_new_tokens"):
            loop.submit([1], 0)
    finally:
        loop.close()


def test_alive_until_closed(engine):
    loop = BatcherLoop(OrtPagedModel(engine, 8), SchedulerConfig(max_batch=1))
    assert loop.alive
    loop.close()
    assert not loop.alive


POISON = 4242  # a token id the engine below fails on (say, a kernel fault one request's input triggers)


class FailingModel:
    """An OrtPagedModel whose forward raises when its ids hold POISON, or on the forwards listed in `fail_at`
    (a transient failure, whatever the rows)."""

    def __init__(self, model, fail_at=()):
        self.model, self.fail_at, self.forwards = model, set(fail_at), 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def run(self, ids, step, picks):
        self.forwards += 1
        if POISON in ids or self.forwards in self.fail_at:
            raise RuntimeError("kernel fault")
        return self.model.run(ids, step, picks)


def test_a_request_that_makes_the_engine_fail_ends_alone(engine):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in (9, 14, 5, 11, 7)]
    prompts[2] = prompts[2][:3] + [POISON] + prompts[2][3:]
    loop = BatcherLoop(FailingModel(OrtPagedModel(engine, 96)), SchedulerConfig(max_batch=4, max_tokens=32, chunk=8))
    try:
        results = [collect(h) for h in [loop.submit(p, 8) for p in prompts]]
        for i, (tokens, end) in enumerate(results):
            if i == 2:
                assert end == ("error", "the engine failed: RuntimeError: kernel fault")
            else:
                assert end[0] == "done" and tokens == alone(engine, prompts[i], 8), i
        tokens, end = collect(loop.submit(prompts[0], 4))  # the loop serves on
        assert end[0] == "done" and tokens == alone(engine, prompts[0], 4)
        assert loop.stats().pages_used == 0
    finally:
        loop.close()


def test_a_transient_engine_failure_ends_no_request(engine):
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in (9, 14, 5, 11)]
    model = FailingModel(OrtPagedModel(engine, 96), fail_at={3})  # the third forward fails, whoever is in it
    loop = BatcherLoop(model, SchedulerConfig(max_batch=4, max_tokens=64, chunk=16))
    try:
        handles = [loop.submit(p, 8) for p in prompts]
        results = [collect(h) for h in handles]
        assert model.forwards > 3
        for prompt, (tokens, end) in zip(prompts, results):
            assert end[0] == "done" and tokens == alone(engine, prompt, 8)
    finally:
        loop.close()
