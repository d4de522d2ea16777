"""kv_layout h2o: the kv_h2o pass (ring graph + attention scores) and the runtime's H2OKVCache.

- the pass is exact (the pass manager compares the logits) and its scores are the attention
  probabilities HF's eager attention computes, summed over the queries;
- before any eviction the H2O engine equals the dense graph;
- after eviction it equals H2OReference (PyTorch: the same policy, scores from its own float64
  softmax) over many evictions, and the cache's memory never changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginesmith.core.errors import UserError
from enginesmith.passes import run_pipeline
from enginesmith.runtime.kv.kv_h2o import H2OKVCache
from enginesmith.runtime.engines.ort_engine import OrtEngine
from helpers.h2o_reference import H2OReference

ATOL = 1e-4


@pytest.fixture(scope="module")
def h2o(tiny_engine, tmp_path_factory):
    made: dict = {}

    def get(family: str, budget: int):
        if (family, budget) not in made:
            dense = tiny_engine(family) / "model.onnx"
            out = tmp_path_factory.mktemp(f"h2o-{family}-{budget}") / "model.onnx"
            report = run_pipeline(dense, out, f"kv_ring:sinks=0:window={budget},kv_h2o", progress=False)
            assert report[1]["exact"] and report[1]["max_diff"] <= report[1]["tolerance"]
            made[family, budget] = dense, out
        return made[family, budget]

    return get


def test_scores_are_the_attention_probabilities(h2o):
    from enginesmith.models.load import load

    _, path = h2o("llama", 16)
    engine = OrtEngine(path, device="cpu")
    cache = engine.new_cache(1)
    assert isinstance(cache, H2OKVCache)
    ids = np.random.default_rng(0).integers(0, 49152, (1, 9))
    engine.forward(ids, np.ones_like(ids), np.zeros_like(ids), cache)
    model = load("tiny:llama").model
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        attn = model(torch.tensor(ids), output_attentions=True).attentions    # per layer [1, H, S, S]
    expected = sum(a[0].double().sum(dim=(0, 1)) for a in attn).numpy()       # [S]
    np.testing.assert_allclose(cache.score[0, :9], expected, atol=1e-4)
    assert not cache.score[0, 9:].any()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_h2o_equals_dense_before_eviction(family, h2o):
    dense_path, path = h2o(family, 16)
    dense, engine = OrtEngine(dense_path, device="cpu"), OrtEngine(path, device="cpu")
    dc, hc = dense.new_cache(1), engine.new_cache(1)
    rng, total = np.random.default_rng(1), 0
    for size in (6, 1, 3, 1, 5):                               # 16 tokens: full, nothing evicted
        ids = rng.integers(0, 49152, (1, size))
        expected = dense.forward(ids, np.ones((1, total + size), np.int64), np.arange(total, total + size)[None], dc)
        got = engine.forward(ids, np.ones_like(ids), np.zeros_like(ids), hc)
        np.testing.assert_allclose(got, expected, atol=ATOL, rtol=0)
        total += size
    assert hc.length == 16 and hc.max_chunk == 1


@pytest.mark.parametrize("family,recent", [("llama", 4), ("qwen2", 0), ("llama", 7)])
def test_h2o_matches_the_reference_over_evictions(family, recent, h2o):
    from enginesmith.models.load import load

    budget = 8
    _, path = h2o(family, budget)
    engine = OrtEngine(path, device="cpu")
    cache = H2OKVCache.for_session(engine.session, 1, "cpu", recent=recent)
    reference = H2OReference(load(f"tiny:{family}").model, budget, recent)
    rng = np.random.default_rng(2)
    size0 = cache.nbytes()
    worst = 0.0
    ids = rng.integers(0, 49152, (1, 5))
    chunks = [ids] + [rng.integers(0, 49152, (1, 1)) for _ in range(30)]   # 27 evictions
    for chunk in chunks:
        got = engine.forward(chunk, np.ones_like(chunk), np.zeros_like(chunk), cache)
        worst = max(worst, float(np.abs(got - reference.forward(chunk)).max()))
        assert sorted(t for t in cache.token[0].tolist() if t >= 0) == reference.arrival  # the same tokens kept
    assert worst <= ATOL, worst
    assert cache.nbytes() == size0 and cache.length == budget and int(cache.count[0]) == 35
    kept = set(cache.token[0].tolist())
    assert set(range(35 - recent, 35)) <= kept                              # the recent tokens stay


def test_h2o_refusals(h2o, tiny_engine):
    _, path = h2o("llama", 8)
    engine = OrtEngine(path, device="cpu")
    cache = engine.new_cache(1)
    ids = np.arange(8)[None]
    engine.forward(ids, np.ones_like(ids), ids, cache)
    with pytest.raises(UserError, match="padding"):
        cache.feeds(np.array([[0, 1]]), np.zeros((1, 2), np.int64))
    with pytest.raises(UserError, match="full H2O cache"):
        cache.feeds(np.ones((1, 2), np.int64), np.zeros((1, 2), np.int64))
    with pytest.raises(UserError, match="kv_ring"):
        run_pipeline(tiny_engine("llama") / "model.onnx", path.parent / "x.onnx", "kv_h2o", progress=False)


def test_build_kv_h2o_engine(tmp_path):
    from enginesmith.builder.engine import BuildConfig, build
    from enginesmith.core.engine_dir import read_manifest
    from enginesmith.runtime.load import open_engine

    config = BuildConfig(model="tiny:llama", kv_layout="h2o", kv_budget=12)
    assert config.key("0" * 64) != BuildConfig(model="tiny:llama", kv_layout="h2o", kv_budget=16).key("0" * 64)
    out = build(config, tmp_path / "engine", progress=False)
    manifest = read_manifest(out)
    assert list(manifest.passes) == ["kv_ring:sinks=0,window=12", "kv_h2o"]
    assert manifest.raw["kv_layout"] == {"type": "ring", "policy": "h2o", "sinks": 0, "window": 12, "capacity": 12}
    engine = open_engine(out, device="cpu").engine
    cache = engine.new_cache(1)
    assert isinstance(cache, H2OKVCache) and cache.capacity == 12
    ids = np.arange(1, 10)[None]
    engine.forward(ids, np.ones_like(ids), ids, cache)
    for t in range(20):                                        # 17 evictions, constant memory
        assert np.isfinite(engine.forward(np.array([[t + 5]]), np.ones((1, 1), np.int64), ids[:, :1], cache)).all()
    assert cache.length == 12 and int(cache.count[0]) == 29
    with pytest.raises(UserError, match="kv-budget"):
        BuildConfig(model="tiny:llama", kv_layout="h2o", kv_budget=4)
