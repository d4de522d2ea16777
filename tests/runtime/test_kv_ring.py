"""kv_layout=ring: the pass, the runtime's RingKVCache and their oracles.

- before any eviction the ring graph's logits equal the dense graph's;
- after eviction they equal `StartRecentReference` (the MIT StreamingLLM policy in PyTorch) within
  fp32 tolerance, over >= 3 wraps of the window, with chunks that wrap around;
- batch rows (left-padded) equal the same rows run alone; the cache never grows and is updated in
  place; bad sizes and chunks are refused with a fix.
Tiny random models (windows of a few tokens make the wraps cheap); SmolLM2 only in a slow test.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.core.errors import UserError
from enginesmith.passes.kv.kv_ring import KVRingParams, kv_ring
from enginesmith.runtime.engines.ort_engine import OrtEngine
from helpers.ring_reference import StartRecentReference

ROPE_FAMILIES = ["llama", "qwen2", "mistral"]
ATOL = 1e-4


def ring_file(src: Path, dst: Path, sinks: int, window: int) -> dict:
    model = ir.load(src)
    counts = kv_ring(model, KVRingParams(sinks, window)).counts
    ir.save(model, dst, external_data=dst.name + ".data")
    return counts


@pytest.fixture(scope="module")
def ring(tiny_engine, tmp_path_factory):
    """ring(family, sinks, window) -> (dense model.onnx, ring model.onnx)."""
    made: dict = {}

    def get(family: str, sinks: int, window: int):
        key = (family, sinks, window)
        if key not in made:
            dense = tiny_engine(family) / "model.onnx"
            out = tmp_path_factory.mktemp(f"ring-{family}-{sinks}-{window}") / "model.onnx"
            ring_file(dense, out, sinks, window)
            made[key] = dense, out
        return made[key]

    return get


@pytest.fixture(scope="module")
def torch_model():
    from enginesmith.models.load import load

    cache: dict = {}

    def get(family):
        if family not in cache:
            cache[family] = load(f"tiny:{family}").model
        return cache[family]

    return get


def stream(engine, cache, ids: np.ndarray) -> np.ndarray:
    """One chunk [B, S] of real tokens (the ring ignores the positions it is given)."""
    return engine.forward(ids, np.ones_like(ids), np.zeros_like(ids), cache)


CHUNKS = [3, 1, 1, 4, 1, 1, 1, 5, 1, 7, 1, 1, 2, 8, 1, 6, 1, 1, 3, 1, 1, 8, 1, 1, 2, 1]  # 64 tokens


@pytest.mark.parametrize("family", ROPE_FAMILIES)
def test_ring_equals_dense_before_eviction(family, ring):
    dense_path, ring_path = ring(family, 4, 12)
    dense, rng_engine = OrtEngine(dense_path, device="cpu"), OrtEngine(ring_path, device="cpu")
    rng = np.random.default_rng(0)
    dc, rc = dense.new_cache(2), rng_engine.new_cache(2)
    total = 0
    for size in (5, 1, 1, 3, 1, 1, 4):  # 16 tokens = 4 sinks + 12 window: full, nothing evicted
        ids = rng.integers(0, 49152, (2, size))
        mask = np.ones((2, total + size), np.int64)
        expected = dense.forward(ids, mask, np.arange(total, total + size)[None].repeat(2, 0), dc)
        np.testing.assert_allclose(stream(rng_engine, rc, ids), expected, atol=ATOL, rtol=0)
        total += size
    assert rc.length == 16 and dc.length == 16


@pytest.mark.parametrize("family,sinks", [("llama", 2), ("qwen2", 3), ("mistral", 1), ("llama", 0)])
def test_ring_matches_streaming_reference_over_wraps(family, sinks, ring, torch_model):
    window = 8
    _, ring_path = ring(family, sinks, window)
    engine = OrtEngine(ring_path, device="cpu")
    cache = engine.new_cache(1)
    reference = StartRecentReference(torch_model(family), sinks, window)
    rng = np.random.default_rng(1)
    worst, wrapped_chunks = 0.0, 0
    for size in CHUNKS:
        ids = rng.integers(0, 49152, (1, size))
        before = int(cache.count[0])
        got, expected = stream(engine, cache, ids), reference.forward(ids)
        worst = max(worst, float(np.abs(got - expected).max()))
        first = (before - sinks) % window if before >= sinks else 0
        wrapped_chunks += before >= sinks and first + size > window  # this chunk's writes wrap around
    wraps = (int(cache.count[0]) - sinks) // window
    assert wraps >= 3 and wrapped_chunks >= 3, (wraps, wrapped_chunks)
    assert worst <= ATOL, worst


def test_batch_rows_equal_the_rows_alone(ring, torch_model):
    """Left-padded prompts of different lengths (one longer than the window, so the engine splits
    it), then decode steps: every row equals its own solo run and the reference."""
    from enginesmith.runtime.decoding.generate import left_pad, positions

    sinks, window = 2, 8
    _, ring_path = ring("llama", sinks, window)
    engine = OrtEngine(ring_path, device="cpu")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 49152, n).tolist() for n in (3, 7, 12)]
    steps = rng.integers(0, 49152, (20, 3))
    ids, mask = left_pad(prompts, 0)
    cache = engine.new_cache(3)
    batched = [engine.forward(ids, mask, positions(mask, ids.shape[1]), cache)[:, -1]]
    for step in steps:
        mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        batched.append(engine.forward(step[:, None], mask, positions(mask, 1), cache)[:, 0])
    for row, prompt in enumerate(prompts):
        alone = engine.new_cache(1)
        reference = StartRecentReference(torch_model("llama"), sinks, window)
        p = np.array([prompt])
        solo = [stream(engine, alone, p)[:, -1]]
        ref = [np.concatenate([reference.forward(p[:, i:i + window]) for i in range(0, p.shape[1], window)],
                              axis=1)[:, -1]]
        for step in steps[:, row]:
            solo.append(stream(engine, alone, np.array([[step]]))[:, 0])
            ref.append(reference.forward(np.array([[step]]))[:, 0])
        got = np.stack([b[row] for b in batched])
        np.testing.assert_allclose(got, np.concatenate(solo), atol=ATOL, rtol=0)
        np.testing.assert_allclose(got, np.concatenate(ref), atol=ATOL, rtol=0)


def test_cache_is_fixed_size_and_updated_in_place(ring):
    _, ring_path = ring("llama", 2, 8)
    engine = OrtEngine(ring_path, device="cpu")
    cache = engine.new_cache(2)
    pointers = [v.data_ptr() for v in cache.windows]
    sink_pointers = {v.data_ptr() for group in cache.sink_buffers for v in group}
    size = cache.nbytes()
    rng = np.random.default_rng(3)
    for chunk in (5, 8, 1, 1, 7, 1, 3):
        stream(engine, cache, rng.integers(0, 49152, (2, chunk)))
        assert [v.data_ptr() for v in cache.windows] == pointers
        assert {v.data_ptr() for group in cache.sink_buffers for v in group} == sink_pointers
        assert all(v.shape() == [2, 2, 8, 16] for v in cache.windows)
    assert cache.nbytes() == size and cache.length == 10 and list(cache.count) == [26, 26]


def test_generate_streams_past_the_capacity(ring):
    """generate() over a ring engine: greedy tokens equal the dense engine's while nothing is
    evicted, and it keeps going (constant memory) far past the capacity."""
    from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids

    dense_path, ring_path = ring("qwen2", 4, 12)
    prompts = [[5, 6, 7, 8, 9], [10, 11]]
    config = GenerationConfig(max_new_tokens=60)
    ring_ids = np.stack([i for i, _ in generate_ids(OrtEngine(ring_path, device="cpu"), prompts, config)])
    dense_ids = np.stack([i for i, _ in generate_ids(OrtEngine(dense_path, device="cpu"), prompts, config)])
    assert ring_ids.shape == (60, 2)
    np.testing.assert_array_equal(ring_ids[:16 - 5 + 1, 0], dense_ids[:16 - 5 + 1, 0])


def test_feeds_follow_the_policy():
    """Slot occupancy and positions of a 2-sink, 4-slot window after 9 tokens, then a wrapping chunk."""
    from enginesmith.runtime.kv.kv_ring import RingKVCache

    cache = RingKVCache(2, 4, {"past": [], "past_sinks": []}, 1, 1, 1, np.float32, "cpu")
    cache.count[:] = 9  # tokens 0,1 in sinks; window tokens 5..8 in slots 3,0,1,2
    feeds = cache.feeds(np.ones((1, 3), np.int64), np.zeros((1, 3), np.int64))
    # after writing tokens 9, 10, 11 (slots 3, 0, 1): window holds 8..11 in slots 2, 3, 0, 1
    assert feeds["write_indices"].tolist() == [3]
    assert feeds["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1]]
    assert feeds["cache_positions"].tolist() == [[0, 1, 4, 5, 2, 3]]
    assert feeds["position_ids"].tolist() == [[3, 4, 5]]
    assert feeds["sink_sources"].tolist() == [[-1, -1]]
    cache.advance([])
    cache.reset()
    feeds = cache.feeds(np.array([[0, 0, 1, 1]]), np.zeros((1, 4), np.int64))  # 2 pads, 2 tokens
    assert feeds["sink_sources"].tolist() == [[2, 3]] and feeds["write_indices"].tolist() == [0]
    assert feeds["attention_mask"].tolist() == [[1, 1, 0, 0, 0, 0]]
    assert feeds["position_ids"].tolist() == [[0, 0, 0, 1]]


def test_bad_sizes_and_chunks_are_refused(ring):
    with pytest.raises(UserError, match="at least 1"):
        KVRingParams(sinks=4, window=0)
    with pytest.raises(UserError, match="negative"):
        KVRingParams(sinks=-1, window=8)
    _, ring_path = ring("llama", 2, 8)
    cache = OrtEngine(ring_path, device="cpu").new_cache(1)
    with pytest.raises(UserError, match="does not fit the KV window of 8"):
        cache.feeds(np.ones((1, 9), np.int64), np.zeros((1, 9), np.int64))
    cache.count[:] = 3
    with pytest.raises(UserError, match="padding"):
        cache.feeds(np.array([[0, 1]]), np.zeros((1, 2), np.int64))


def test_models_without_rope_or_attention_are_refused(tiny_engine, ring):
    with pytest.raises(UserError, match="rotary"):
        kv_ring(ir.load(tiny_engine("gpt2") / "model.onnx"), KVRingParams(4, 8))
    with pytest.raises(UserError, match="already has a ring"):
        kv_ring(ir.load(ring("llama", 2, 8)[1]), KVRingParams(4, 8))


def test_runs_in_the_pass_pipeline(tiny_engine, tmp_path):
    from enginesmith.passes import run_pipeline

    report = run_pipeline(tiny_engine("mistral") / "model.onnx", tmp_path / "ring.onnx",
                          "kv_ring:sinks=2,window=8", progress=False)
    assert report[0]["counts"] == {"ring_layers": 2}
    assert report[0]["max_diff"] is not None and report[0]["max_diff"] <= report[0]["tolerance"]


@pytest.mark.slow
def test_smollm2_ring_equals_dense_before_eviction(smollm2_onnx, tmp_path):
    out = tmp_path / "model.onnx"
    assert ring_file(smollm2_onnx, out, 4, 60)["ring_layers"] == 30
    dense, ring_engine = OrtEngine(smollm2_onnx, device="cpu"), OrtEngine(out, device="cpu")
    ids = np.random.default_rng(0).integers(0, 49152, (1, 48))
    expected = dense.forward(ids, np.ones_like(ids), np.arange(48)[None], dense.new_cache(1))
    np.testing.assert_allclose(stream(ring_engine, ring_engine.new_cache(1), ids), expected, atol=5e-4, rtol=0)


@pytest.mark.parametrize("argv,message", [
    (["run", "--model", "tiny:llama", "--kv", "ring", "--kv-window", "0", "hi"], "window >= 1"),
    (["run", "--model", "tiny:llama", "--kv", "ring", "--sinks", "-1", "hi"], "sinks >= 0"),
    (["run", "--model", "tiny:llama", "--kv", "ring", "--sinks", "4", "--kv-window", "1000", "hi"],
     "exceeds the model's context of 512"),
    (["run", "--model", "tiny:gpt2", "--kv", "ring", "hi", "--sinks", "2", "--kv-window", "8"], "rotary"),
    (["run", "--engine", "/nonexistent", "--kv", "ring", "hi"], "--kv was given with --engine"),
    (["eval", "ppl", "--model", "tiny:llama", "--kv", "ring,bogus"], "unknown --kv policy bogus"),
    (["eval", "ppl", "--model", "tiny:llama", "--kv", "recompute", "--stride", "0"], "--stride 0"),
])
def test_cli_refuses_bad_ring_settings(argv, message, capsys):
    from enginesmith.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: ") and message in err and "(fix: " in err


def test_cli_run_and_eval_with_a_ring(capsys, tmp_path, austen):
    from enginesmith.cli import main

    assert main(["run", "--model", "tiny:llama", "--kv", "ring", "--sinks", "2", "--kv-window", "8",
                 "--max-tokens", "40", "--raw", "Hello there"]) == 0
    assert len(capsys.readouterr().out.split()) > 20  # far past the 10-slot cache
    plot = tmp_path / "ppl.png"
    assert main(["eval", "ppl", "--model", "tiny:llama", "--kv", "dense,window,ring,recompute", "--sinks", "2",
                 "--kv-window", "14", "--tokens", "120", "--plot", str(plot), "--json"]) == 0
    import json

    runs = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]
    assert [r["policy"] for r in runs] == ["dense", "window", "ring", "recompute"]
    assert all(r["tokens"] == 119 for r in runs) and plot.stat().st_size > 10_000
    assert runs[2]["cache_mib_first"] == runs[2]["cache_mib_last"]  # the ring does not grow


def test_chat_session_keeps_one_cache(tiny_engine):
    """Turns continue one ring cache: later turns feed only their own tokens."""
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.load import open_engine
    from enginesmith.runtime.decoding.ring_chat import ChatSession
    from enginesmith.builder.engine import BuildConfig, cached_engine

    loaded = open_engine(cached_engine(BuildConfig(model="tiny:qwen2", kv_layout="ring", kv_sinks=4,
                                                   kv_window=60), progress=False), device="cpu")
    session = ChatSession(loaded.engine, loaded.tokenizer, GenerationConfig(max_new_tokens=30))
    first = "".join(session.turn("Hello! Tell me a long story about the sea."))
    prompt_first = session.last.prompt_tokens
    for _ in range(4):
        "".join(session.turn("And then?"))
        assert session.last.prompt_tokens < prompt_first  # no system line, no history re-fed
    assert first and session.generated == 150 and session.cache.count[0] > 64  # wrapped


def test_recompute_with_last_token_graph_is_exact(ring, tmp_path):
    """Re-computation through the last-position-logits copy of the graph scores every token exactly
    as the full-logits graph does."""
    from enginesmith.measure import streaming

    dense_path, _ = ring("llama", 2, 8)
    last = streaming.last_token_graph(dense_path, tmp_path / "last.onnx")
    dense, last_engine = OrtEngine(dense_path, device="cpu"), OrtEngine(last, device="cpu")
    ids = np.random.default_rng(4).integers(0, 49152, 60)
    full = streaming.run_recompute(dense, ids, window=10, stride=1, batch=4, progress=False)
    fast = streaming.run_recompute(dense, ids, window=10, stride=1, batch=4, progress=False, last_engine=last_engine)
    assert not np.isnan(full.nll).any()
    np.testing.assert_allclose(fast.nll, full.nll, atol=1e-6)


def test_streaming_chat_benchmark_short_version(tmp_path):
    """benchmarks/streaming/chat_stream.py, short: a session far past the cache in constant memory."""
    import json
    import subprocess
    import sys

    script = Path(__file__).parents[2] / "benchmarks" / "streaming" / "chat_stream.py"
    subprocess.run([sys.executable, str(script), "--model", "tiny:llama", "--tokens", "600", "--sinks", "2",
                    "--kv-window", "30", "--turn-tokens", "50", "--every", "100", "--warmup", "200",
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    result = json.loads((tmp_path / "chat_stream.json").read_text())
    assert result["generated_tokens"] >= 600 and result["tokens_through_cache"] > 20 * 32
    assert len({s["cache_mib"] for s in result["samples"]}) == 1
    assert result["rss_growth_mib"] < 20, result["rss_growth_mib"]


def test_ring_too_small_for_the_output_check_is_a_user_error(tiny_engine, tmp_path):
    """The pass manager's check feeds 7 tokens before any eviction: a smaller ring is refused with a
    UserError that says how large it must be, not a traceback, and nothing is written."""
    from enginesmith.passes import run_pipeline

    with pytest.raises(UserError, match="at least 8 tokens"):
        run_pipeline(tiny_engine("llama") / "model.onnx", tmp_path / "ring.onnx", "kv_ring:sinks=1,window=3",
                     progress=False)
    assert not (tmp_path / "ring.onnx").exists()
