"""Sliding-window layers give their pages back (runtime/kv/block_manager.py, issue 29 goal 4).

The oracle: a Python reference paged model (`WindowRefModel`) that writes each token's key through the
slot mapping and attends, as the paged kernels do, to its last W positions read through the block
table from the page holding the step's first position - W + 1 on (plugins/ort_ops/paged_gqa.h: pages
before it are never read; the model asserts none of the pages it reads is the null page). Its token is
a hash of the keys it attends to, so a page given back too early (and reused by another request, or
left null) changes the tokens. Run with the window's page freeing on and off, the tokens must be the
same; with it on, a request never holds more than `window_pages(chunk)` pages, whatever its length,
and every page comes back at the end.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from helpers.external import needs_cuda

from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig
from enginesmith.runtime.kv.block_manager import KVCacheManager

BS, W, VOCAB = 4, 11, 97


class WindowRefModel:
    """A PagedModel whose attention is a sliding window of W keys over its page pool (numpy)."""

    max_positions = None

    def __init__(self, num_pages: int, window: int = W, free_pages: bool = True, max_chunk: int | None = 8):
        self.num_pages, self.page_size, self.max_chunk = num_pages, BS, max_chunk
        self.window = window
        self.kv_window = window if free_pages else None  # what the batcher reads: pages behind it go back
        self.pool = np.zeros((num_pages, BS), np.int64)

    def copy_pages(self, copies) -> None:
        for src, dst in copies:
            self.pool[dst] = self.pool[src]

    def run(self, ids, step, picks) -> list[int]:
        width = ids.shape[1]
        for b in range(ids.shape[0]):
            for s in range(width):
                slot = int(step.slot_mapping[b, s])
                if slot >= 0:
                    pos = int(step.context_lens[b]) - width + s
                    self.pool.flat[slot] = (int(ids[b, s]) * 1009 + pos * 7919) % 100003
        return [self._token(step, width, pick.row, pick.col) for pick in picks]

    def _token(self, step, width: int, row: int, col: int) -> int:
        ctx = int(step.context_lens[row])
        table = step.block_tables[row]
        first_page = max(0, ctx - width - self.window + 1) // BS  # the kernels' first page read
        real_end = ctx - width + int((step.slot_mapping[row] >= 0).sum())  # (padding reads the null page)
        assert all(table[i] != 0 for i in range(first_page, -(-real_end // BS))), "a page the kernel reads is null"
        pos = ctx - width + col
        keys = [int(self.pool[table[j // BS], j % BS]) for j in range(max(0, pos - self.window + 1), pos + 1)]
        return hash(tuple(keys)) % VOCAB


def _requests(seed: int, n: int = 12) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(VOCAB) for _ in range(3 * BS)]  # a common prefix: prefix-cache hits
    out = []
    for _ in range(n):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 40))]
        out.append((prompt, rng.randint(1, 60)))
    return out


def _run(model, requests, async_steps: bool, cancel: dict[int, int] | None = None, chunk: int = 8):
    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=4, max_tokens=24, chunk=chunk,
                                                       async_steps=async_steps, reserve_new_tokens=8))
    ids = [batcher.add_request(p, n, request_id=f"r{i}") for i, (p, n) in enumerate(requests)]
    bound = batcher.manager.window_pages(batcher.chunk)
    steps, most = 0, 0
    while batcher.has_unfinished:
        if cancel and steps in cancel:
            batcher.cancel(ids[cancel[steps]])
        batcher.step()
        steps += 1
        batcher.manager.check_invariants()
        held = [batcher.manager.num_held(r.request_id) for r in batcher.running]
        most = max([most] + held)
        if bound is not None:
            assert all(h <= bound for h in held), (held, bound)
    batcher.close()
    assert batcher.manager.num_free_blocks == model.num_pages - 1, "a page leaked"
    batcher.manager.check_invariants()
    return {rid: r.output for rid, r in batcher.finished.items()}, most


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_freeing_behind_the_window_keeps_the_tokens_and_bounds_the_pages(seed, async_steps):
    requests = _requests(seed)
    want, most_before = _run(WindowRefModel(64, free_pages=False), requests, async_steps)
    got, most_after = _run(WindowRefModel(64), requests, async_steps)
    assert got == want
    assert most_after <= KVCacheManager(64, BS, window=W).window_pages(8) < most_before


def test_cancellations_and_preemption_under_a_small_pool_leak_no_page():
    """A pool too small for the load: requests are preempted and recomputed, some cancelled mid-way;
    the same tokens as a roomy pool without freeing, every page back."""
    requests = _requests(7, 16)
    cancel = {3: 2, 9: 5, 20: 11}
    want, _ = _run(WindowRefModel(256, free_pages=False), requests, False)
    for async_steps in (False, True):
        got, _ = _run(WindowRefModel(24), requests, async_steps, cancel)
        for i, rid in enumerate(sorted(want)):
            gone = int(rid[1:]) in cancel.values()  # cut short: a prefix of its tokens
            assert got[rid] == want[rid][:len(got[rid])] if gone else got[rid] == want[rid], rid


def test_a_long_request_fits_a_pool_smaller_than_its_context():
    """600 tokens need 150 pages of 4 without the window; with it the request runs in a pool of 12."""
    prompt = [(7 * i) % VOCAB for i in range(40)]
    want, _ = _run(WindowRefModel(200, free_pages=False), [(prompt, 560)], False)
    got, most = _run(WindowRefModel(12), [(prompt, 560)], False)
    assert got == want and most <= KVCacheManager(12, BS, window=W).window_pages(8) == 8


def test_block_manager_window_invariants_under_random_operations():
    """Allocations in random chunks, prefix hits, forks, rollbacks and frees with a window: the
    invariants hold after every operation, a request's held pages stay bounded, nothing leaks."""
    rng = random.Random(3)
    m = KVCacheManager(num_blocks=400, block_size=BS, window=W)
    chunk, tokens, live = 6, {}, []
    for op in range(1500):
        kind = rng.random()
        if kind < 0.15 or not live:
            rid = f"q{op}"
            prompt = [rng.randrange(3) for _ in range(rng.randint(1, 30))]  # few symbols: many prefix hits
            hits, n = m.get_computed_blocks(prompt)
            if m.allocate_slots(rid, min(len(prompt) - n, chunk), hits) is not None:
                tokens[rid], live = prompt, live + [rid]
        elif kind < 0.8:
            rid = rng.choice(live)
            have = m.num_tokens(rid)
            more = rng.randint(0, chunk)
            while len(tokens[rid]) < have + more:
                tokens[rid].append(rng.randrange(3))
            if m.allocate_slots(rid, more) is not None:
                m.cache_blocks(rid, tokens[rid], have)  # what the previous step wrote
        elif kind < 0.85:
            child = f"f{op}"
            parent = rng.choice(live)
            m.fork(parent, child)
            tokens[child], live = list(tokens[parent][:m.num_tokens(parent)]), live + [child]
        elif kind < 0.9:
            rid = rng.choice(live)
            back = max(m.num_tokens(rid) - rng.randint(0, 3), 0)
            try:
                m.truncate(rid, back)
                del tokens[rid][max(back, 0):]
            except ValueError:
                pass  # into pages already given back: refused, nothing changed
        else:
            rid = live.pop(rng.randrange(len(live)))
            m.free(rid)
        m.check_invariants()
        for rid in live:
            assert m.num_held(rid) <= m.window_pages(chunk), (rid, m.num_held(rid))
    for rid in live:
        m.free(rid)
    m.check_invariants()
    assert m.num_free_blocks == 399


def test_pages_behind_the_window_point_at_the_null_page():
    m = KVCacheManager(num_blocks=64, block_size=BS, window=W)
    for _ in range(10):
        m.allocate_slots("a", 4)                                 # 40 positions in steps of 4
    # the 10th step gave back what is behind the window of the 9th's start (32: position 22, page 5 on),
    # pages 0..4; the 10th step (from 36) may still be in flight
    assert m.block_ids("a")[:5] == (0,) * 5 and 0 not in m.block_ids("a")[5:]
    assert m.num_held("a") == 5 and m.num_free_blocks == 63 - 5
    with pytest.raises(ValueError, match="behind the window"):
        m.truncate("a", 20)
    assert KVCacheManager(64, BS).window_pages(4) is None and KVCacheManager(64, BS).pages_for(40, 4) == 10


# ---------------------------------------------------------------- the real paged op, on the CPU

@pytest.fixture(scope="module")
def windowed_engine(ort_ops_lib, tmp_path_factory):
    """tiny:gemma2 lowered for the paged CUDA engine (its CPU kernel runs here), then every layer's
    PagedGroupQueryAttention given a window of 8 (Mistral-style: all layers windowed, head size 256;
    tiny:mistral-sw's head size 16 is refused by the op). Returns (the mixed engine, the windowed one)."""
    pytest.importorskip("onnxruntime")
    onnx = pytest.importorskip("onnx")
    import json

    from enginesmith.builder.engine import BuildConfig, build, cached_engine
    from enginesmith.core import engine_dir

    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    root = tmp_path_factory.mktemp("gemma2w")
    src = cached_engine(BuildConfig(model="tiny:gemma2", dtype="fp16"), progress=False)
    mixed = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=160, kv_layout="paged", page_size=16,
                              max_batch=4), root / "mixed", source=src, progress=False)
    windowed = root / "windowed"
    import shutil
    shutil.copytree(mixed, windowed)
    model = onnx.load(str(mixed / "model.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "PagedGroupQueryAttention":
            kept = [a for a in node.attribute if a.name != "local_window_size"]
            del node.attribute[:]
            node.attribute.extend(kept + [onnx.helper.make_attribute("local_window_size", 8)])
    onnx.save(model, str(windowed / "model.onnx"))
    raw = json.loads((windowed / "build.json").read_text())
    (windowed / "build.json").unlink()
    engine_dir.write_manifest(windowed, {k: v for k, v in raw.items() if k not in ("format_version", "files")})
    yield mixed, windowed
    mp.undo()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_the_paged_op_gives_the_same_tokens_with_pages_given_back(windowed_engine, device):
    """Greedy tokens of 4 requests (prompts of 5..37 tokens, 40..120 new) through the paged op (its CPU
    kernel here, the CUDA kernel and the engine's CUDA graphs on the device): the same with the window's
    pages given back as with every page kept; a request then holds at most window_pages(16) = 4 pages of
    16 instead of up to 8. Both runs schedule the same batches, so the GEMMs see the same rows and the
    tokens must be equal, not just close. Gemma 2 as built (a global layer beside the windowed one) frees
    nothing: kv_window None."""
    from enginesmith.runtime.engines.paged_cuda import open_paged_engine

    mixed, windowed = windowed_engine
    assert open_paged_engine(mixed, device=device, num_pages=40).engine.kv_window is None
    rng = random.Random(5)
    requests = [([rng.randrange(2, 200) for _ in range(n)], m) for n, m in ((5, 120), (37, 40), (16, 50), (23, 45))]
    outs, most = {}, {}
    for free in (False, True):
        engine = open_paged_engine(windowed, device=device, num_pages=40).engine
        assert engine.layer_windows == [8, 8] and engine.kv_window == 8
        if not free:
            engine.kv_window = None
        outs[free], most[free] = _run(engine, requests, False, chunk=16)
    assert outs[True] == outs[False]
    assert most[True] <= 4 < most[False] == 8
