"""The model families of models/families.py, each on a tiny random model of its real transformers class.

- export: fp32 logits within 1e-3 of transformers (prefill and decode with a KV cache), 64 greedy
  tokens identical (the sliding windows of 8 and Phi-3's LongRoPE switch at 32 are crossed);
- the support table (`enginesmith models`) says what the passes do: a "yes" runs, a "no" is refused
  with a UserError, for every tiny model and every pass, KV layout and CUDA lowering;
- sliding windows: the ring layout of a model whose layers all slide is the exact window (64 greedy
  tokens equal transformers') and keeps only `window` tokens; lower_gqa's local_window_size equals
  the unlowered graph on the CPU; layouts without a window refuse;
- unsupported rope types and attention variants are refused naming what is supported;
- generation through the paged CPU graph of a new family equals the dense one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from enginesmith.core.errors import UserError
from enginesmith.models import config_check
from enginesmith.models import load as models
from enginesmith.models.families import FAMILIES, features_of, limits, support
from enginesmith.passes import from_tokens, run_pipeline
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids
from enginesmith.runtime.load import open_engine
from helpers.parity import TOL, _prompts, ort_greedy, torch_greedy
from enginesmith.export import adapter
from enginesmith.runtime.decoding.generate import positions

NEW = ["llama3", "qwen3", "granite", "olmo2", "phi3", "gemma2", "gemma3", "mistral-sw", "seed_oss"]
ALL_TINY = [t for f in FAMILIES.values() for t in f.tiny if t != "llama-hd64"]


@pytest.fixture(scope="module")
def torch_model():
    cache: dict = {}

    def get(name):
        if name not in cache:
            cache[name] = models.load(f"tiny:{name}").model
        return cache[name]

    return get


# ----------------------------------------------------------------------------- export parity

@pytest.mark.parametrize("name", NEW)
def test_prefill_decode_and_64_greedy_tokens_match_transformers(name, tiny_engine, torch_model):
    model, engine = torch_model(name), open_engine(tiny_engine(name), device="cpu").engine
    prompt = _prompts(engine.vocab)[0] + _prompts(engine.vocab, seed=3)[0]  # 22 tokens: past a window of 8
    cache = engine.new_cache(1)
    ids = np.array([prompt])
    mask = np.ones_like(ids)
    got = engine.forward(ids, mask, positions(mask, ids.shape[1]), cache)
    with torch.no_grad():
        ref = adapter.forward(model, torch.tensor(ids), torch.tensor(mask),
                              torch.tensor(positions(mask, ids.shape[1])), adapter.make_cache(model.config, []))
    assert np.abs(got - ref.logits.numpy()).max() <= TOL
    ref_cache = adapter.output_cache(ref)
    for step in range(12):  # Phi-3: positions 22..33 cross LongRoPE's switch at 32
        nxt = np.array([[int(got[0, -1].argmax())]])
        mask = np.concatenate([mask, [[1]]], 1)
        got = engine.forward(nxt, mask, positions(mask, 1), cache)
        with torch.no_grad():
            ref = adapter.forward(model, torch.tensor(nxt), torch.tensor(mask), torch.tensor(positions(mask, 1)),
                                  ref_cache)
        ref_cache = adapter.output_cache(ref)
        assert np.abs(got - ref.logits.numpy()).max() <= TOL, f"decode step {step}"
    prompt = _prompts(engine.vocab, seed=1)[0]
    assert ort_greedy(engine, [prompt], 64)[0] == torch_greedy(model, prompt, 64)


def test_export_leaves_the_model_as_it_was(tmp_path):
    """Tracing Phi-3's LongRoPE caches a traced tensor on the module; export must not leave it there."""
    from enginesmith.export.to_onnx import export

    model = models.load("tiny:phi3").model
    ids = torch.tensor([list(range(3, 43))])  # 40 tokens: the long factors
    with torch.no_grad():
        before = model(ids).logits
    export(model, tmp_path / "model.onnx")
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


# ----------------------------------------------------------------------------- the support table

CALIB = None


def _calibration():
    global CALIB
    if CALIB is None:
        CALIB = from_tokens(np.random.default_rng(0).integers(0, 49152, size=4 * 32 + 7), "random:test",
                            samples=4, seq_len=32)
    return CALIB


def _pipeline(column: str, features: tuple[str, ...]) -> str:
    ring = "kv_ring:sinks=0:window=16" if "sliding_window" in features else "kv_ring:sinks=4:window=16"
    return {"smoothquant": "smoothquant:alpha=0.5", "w4a16-rtn": "quantize_w4a16:block_size=16",
            "w4a16-awq": "awq:block_size=16,quantize_w4a16:block_size=16", "w8a8": "quantize_w8a8",
            "ring": ring, "paged": "kv_paged:page_size=4",
            "GroupQueryAttention": "fuse_attention,lower_gqa:capacity=64"}[column]


@pytest.mark.parametrize("name", ALL_TINY)
def test_support_table_says_what_the_passes_do(name, tiny_engine, tmp_path):
    family = models.load(f"tiny:{name}").family
    features = features_of(family, models.load(f"tiny:{name}").model.config)
    verdicts = limits(features)
    for column in ("smoothquant", "w4a16-rtn", "w4a16-awq", "w8a8", "ring", "paged", "GroupQueryAttention"):
        out = tmp_path / column / "model.onnx"
        # the GQA column is the CUDA path, which lowers fp16 exports
        src = (fp16_engine(name) if column == "GroupQueryAttention" else tiny_engine(name)) / "model.onnx"
        if verdicts[column] == "yes":
            run_pipeline(src, out, _pipeline(column, features), calibration=_calibration(), progress=False)
        else:
            with pytest.raises(UserError):
                run_pipeline(src, out, _pipeline(column, features), calibration=_calibration(), progress=False)


@pytest.mark.parametrize("name", ALL_TINY)
def test_fp16_export_runs_as_the_fp32_one(name, tiny_engine):
    """Every family exports in fp16 (the CUDA engines' precision) and ONNX Runtime loads it: RMSNorms that
    normalize in fp32 (OLMo 2, Gemma) and LongRoPE's fp32 tables (Phi-3) broke this once. Logits equal the
    fp32 engine's to fp16 rounding through a prefill and decode steps."""
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    same_fp16_logits(OrtEngine(fp16_engine(name) / "model.onnx", device="cpu", threads=1),
                     OrtEngine(tiny_engine(name) / "model.onnx", device="cpu", threads=1))


def fp16_engine(name: str):
    """The fp16 export of tiny:<name>: what the CUDA path (lower_gqa) starts from."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    return cached_engine(BuildConfig(model=f"tiny:{name}", dtype="fp16"), progress=False)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3", "olmo2"])
def test_lower_gqa_keeps_softcap_windows_and_qk_norms(name, tmp_path):
    """fuse_attention + lower_gqa on the fp16 exports: Gemma 2's soft-capping becomes the Attention op's and
    then GroupQueryAttention's softcap (exact against the eager graph in fp32), the sliding layers keep
    local_window_size, q/k RMSNorms (Qwen 3, Gemma 3: per head; OLMo 2: over the projection, rotated in fp32
    between Casts) stay before the op's RoPE. The lowered graph on the CPU EP against the unlowered one: logits through a prefill past the window and decode steps."""
    import onnx

    from enginesmith.runtime.engines.ort_cuda import GqaEngine
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src = fp16_engine(name) / "model.onnx"
    out = tmp_path / "model.onnx"
    report = run_pipeline(src, out, "fuse_attention,lower_gqa:capacity=64", progress=False)
    assert report[1]["counts"] == {"gqa": 2, "not_lowered": 0}
    assert report[0]["counts"]["attention_fused"] == (2 if name == "gemma2" else 0)
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
             for n in onnx.load(str(out), load_external_data=False).graph.node if n.op_type == "GroupQueryAttention"]
    windows = [a.get("local_window_size") for a in attrs]
    assert windows == ([8, None] if name in ("gemma2", "gemma3") else [None, None])  # sliding, then global
    assert [a.get("softcap") for a in attrs] == ([50.0, 50.0] if name == "gemma2" else [None, None])
    ref, low = OrtEngine(src, device="cpu", threads=1), GqaEngine(out, device="cpu", max_batch=1, capacity=64,
                                                                   threads=1)
    same_fp16_logits(low, ref)


def same_fp16_logits(engine, reference) -> None:
    """`engine`'s logits equal `reference`'s to fp16 rounding (2 % of the largest logit) over a prefill of
    20 tokens (past the tiny models' window of 8) and decode steps, one of 4 tokens among them."""
    c_eng, c_ref, past = engine.new_cache(1), reference.new_cache(1), 0
    rng = np.random.default_rng(0)
    for n in (20, 1, 1, 4, 1):
        ids = rng.integers(0, reference.vocab, (1, n))
        mask, pos = np.ones((1, past + n), np.int64), np.arange(past, past + n)[None]
        a = np.asarray(engine.forward(ids, mask, pos, c_eng), np.float32)
        b = np.asarray(reference.forward(ids, mask, pos, c_ref), np.float32)
        assert np.abs(a - b).max() <= 2e-2 * max(1.0, np.abs(b).max()), f"step of {n} tokens"
        past += n


def test_smoothquant_reports_the_sites_it_cannot_fold(tiny_engine, tmp_path):
    """OLMo 2 normalizes after the blocks: q/k/v and gate/up read the residual stream, no norm precedes
    them. SmoothQuant folds what it can (v -> o, up -> down) and names the rest with the reason."""
    report = run_pipeline(tiny_engine("olmo2") / "model.onnx", tmp_path / "model.onnx", "smoothquant:alpha=0.5",
                          calibration=_calibration(), progress=False)[0]
    assert report["counts"]["norm"] == 0 and report["counts"]["attn_v"] == 2 and report["counts"]["mlp_up"] == 2
    reasons = [s["reason"] for s in report["skipped"] if "lm_head" not in s["reason"]]
    assert len(reasons) == report["counts"]["linears_not_smoothed"] == 10
    assert all("cannot absorb a per-channel scale" in r for r in reasons)


# ----------------------------------------------------------------------------- sliding windows

def test_ring_is_the_exact_sliding_window_and_keeps_only_it(tiny_engine, torch_model):
    """Mistral with a window of 8 on a ring of 16 slots (no sinks): 64 greedy tokens as transformers,
    and the cache never holds more than the ring."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    path = cached_engine(BuildConfig(model="tiny:mistral-sw", kv_layout="ring", kv_sinks=0, kv_window=16),
                         progress=False)
    loaded = open_engine(path, device="cpu")
    layout = json.loads((path / "build.json").read_text())["kv_layout"]
    assert layout["window"] == 16 and layout["sinks"] == 0
    prompt = _prompts(loaded.engine.vocab, seed=1)[0]
    assert ort_greedy(loaded.engine, [prompt], 64)[0] == torch_greedy(torch_model("mistral-sw"), prompt, 64)
    cache = loaded.engine.new_cache(1)
    assert cache.capacity == 16 and all(tuple(buf.shape())[2] == 16 for buf in cache.windows)
    # a prompt longer than the ring is prefilled in chunks of at most window - W + 1 = 9 tokens (exact)
    assert cache.max_chunk == 9
    long_prompt = list(np.random.default_rng(5).integers(3, loaded.engine.vocab, 40))
    assert ort_greedy(loaded.engine, [long_prompt], 16)[0] == torch_greedy(torch_model("mistral-sw"), long_prompt, 16)


def test_sinks_and_short_rings_are_refused_for_sliding_windows(tiny_engine, tmp_path):
    src = tiny_engine("mistral-sw") / "model.onnx"
    with pytest.raises(UserError, match="--sinks 0"):
        run_pipeline(src, tmp_path / "a.onnx", "kv_ring:sinks=4:window=16", progress=False)
    with pytest.raises(UserError, match="smaller than the model's sliding window of 8"):
        run_pipeline(src, tmp_path / "b.onnx", "kv_ring:sinks=0:window=4", progress=False)
    with pytest.raises(UserError, match="sliding window of 8 tokens, which the paged layout does not implement"):
        run_pipeline(src, tmp_path / "c.onnx", "kv_paged:page_size=4", progress=False)
    with pytest.raises(UserError, match="sliding and global layers alternate"):
        run_pipeline(tiny_engine("gemma3") / "model.onnx", tmp_path / "d.onnx", "kv_ring:sinks=0:window=16",
                     progress=False)
    with pytest.raises(UserError, match="soft-capping"):
        run_pipeline(tiny_engine("gemma2") / "model.onnx", tmp_path / "e.onnx", "kv_ring:sinks=0:window=16",
                     progress=False)


def test_lower_gqa_keeps_the_sliding_window(tiny_engine, tmp_path):
    """GroupQueryAttention's local_window_size on the CPU EP equals the unlowered graph's windowed mask
    over a prefill longer than the window, decode steps and a multi-token step."""
    import onnx

    from enginesmith.runtime.engines.ort_cuda import GqaEngine
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src = tiny_engine("mistral-sw") / "model.onnx"
    out = tmp_path / "model.onnx"
    run_pipeline(src, out, "lower_gqa:capacity=64", progress=False)
    windows = [a.i for n in onnx.load(str(out), load_external_data=False).graph.node
               if n.op_type == "GroupQueryAttention" for a in n.attribute if a.name == "local_window_size"]
    assert windows == [8, 8]
    ref, low = OrtEngine(src, device="cpu", threads=1), GqaEngine(out, device="cpu", max_batch=1, capacity=64,
                                                                   threads=1)
    c_ref, c_low, past = ref.new_cache(1), low.new_cache(1), 0
    rng = np.random.default_rng(0)
    for n in (20, 1, 1, 4, 1):
        ids = rng.integers(0, ref.vocab, (1, n))
        mask, pos = np.ones((1, past + n), np.int64), np.arange(past, past + n)[None]
        np.testing.assert_allclose(low.forward(ids, mask, pos, c_low), ref.forward(ids, mask, pos, c_ref), atol=1e-4)
        past += n


def test_export_records_windows_and_softcaps(tiny_engine):
    import onnx

    from enginesmith.export import attention_meta

    def meta(name):
        props = {p.key: p.value for p in onnx.load(str(tiny_engine(name) / "model.onnx"),
                                                     load_external_data=False).metadata_props}
        return json.loads(props[attention_meta.METADATA_KEY])

    gemma2 = meta("gemma2")
    assert [layer["window"] for layer in gemma2["layers"]] == [8, None]
    assert {layer["softcap"] for layer in gemma2["layers"]} == {50.0} and gemma2["final_logit_softcap"] == 30.0
    assert [layer["window"] for layer in meta("mistral-sw")["layers"]] == [8, 8]
    assert [layer["window"] for layer in meta("llama")["layers"]] == [None, None]


def test_sliding_window_kv_memory_at_long_context():
    """The figure for the report: per-sequence KV bytes of a Mistral-7B-v0.1 shape (32 layers, 8 KV
    heads, head 128, window 4096, fp16) at 32k tokens, dense vs the ring of 4096 slots."""
    layers, kv_heads, head_dim, window, context, fp16 = 32, 8, 128, 4096, 32768, 2
    per_token = 2 * layers * kv_heads * head_dim * fp16
    dense, ring = per_token * context, per_token * window
    assert (dense, ring) == (4 * 2**30, 512 * 2**20)  # 4 GiB dense vs 512 MiB: 8x less


# ----------------------------------------------------------------------------- refusals

@pytest.mark.parametrize("config,message", [
    (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type 'dynamic' is not supported.*default, llama3"),
    (dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "yarn"},
                                                     "sliding_attention": {"rope_type": "default"}}),
     "rope_type 'yarn' is not supported.*default, linear"),
    (dict(model_type="qwen2", use_sliding_window=True), "use_sliding_window is not supported"),
    (dict(model_type="llama", attn_implementation="flex_attention"), "'flex_attention' is not supported"),
    (dict(model_type="gemma", hidden_size=64), "unsupported architecture.*gemma2"),
])
def test_unsupported_features_are_refused_with_what_is_supported(config, message):
    base = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=100)
    with pytest.raises(UserError, match=message) as info:
        config_check.check(Path("config.json"), {**base, **config})
    assert info.value.fix


def test_every_tiny_model_is_listed_and_loads_as_its_family():
    from enginesmith.models import tiny

    listed = {f"tiny:{t}" for f in FAMILIES.values() for t in f.tiny}
    assert listed == {n for n in tiny.names() if n.startswith("tiny:")}
    for family in FAMILIES.values():
        for name in family.tiny:
            assert models.load(f"tiny:{name}").family is family


# ----------------------------------------------------------------------------- runtime on a new family

def test_paged_cpu_graph_generates_as_the_dense_one(tiny_engine):
    """Qwen3 through runtime.decoding.generate on the paged CPU graph: a left-padded batch, greedy, equal to dense."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    paged = open_engine(cached_engine(BuildConfig(model="tiny:qwen3", kv_layout="paged", page_size=4),
                                      progress=False), device="cpu").engine
    dense = open_engine(tiny_engine("qwen3"), device="cpu").engine
    prompts = _prompts(dense.vocab, seed=2)
    config = GenerationConfig(max_new_tokens=20)
    want = np.stack([ids for ids, _ in generate_ids(dense, prompts, config)])
    got = np.stack([ids for ids, _ in generate_ids(paged, prompts, config)])
    np.testing.assert_array_equal(got, want)


def test_speculative_decoding_is_lossless_on_a_new_family(tiny_engine):
    from enginesmith.runtime.decoding import speculative as sp

    engine = open_engine(tiny_engine("gemma3"), device="cpu").engine
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]
    config = GenerationConfig(max_new_tokens=30)
    out = list(sp.speculative_tokens(engine, sp.NgramDrafter(), prompt, config, sp.SpeculativeConfig(k=4),
                                     sp.SpeculativeStats()))
    assert out == ort_greedy(engine, [prompt], 30)[0]


# ----------------------------------------------------------------------------- enginesmith models

def test_models_verb_prints_the_table_and_json(capsys):
    from enginesmith.cli import main

    assert main(["models"]) == 0
    text = capsys.readouterr().out
    for family in FAMILIES.values():
        assert family.architecture in text
    assert "gemma2 paged: no soft-capping in the CPU paged layout" in text
    # a "yes*" cell is listed as a limit, not as unsupported
    limits, unsupported = text.split("Supported with limits (yes*):")[1].split("Not supported (why):")
    assert "mistral paged: not with sliding_window" in limits and "mistral paged" not in unsupported
    assert main(["models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {f.name for f in FAMILIES.values()}
    assert data["gemma3"]["support"] == support(FAMILIES["gemma3_text"])
    assert data["mistral"]["support"]["paged"].startswith("yes (not with sliding_window")
    assert data["qwen3"]["support"]["GroupQueryAttention"] == "yes"
    assert data["olmo2"]["support"]["GroupQueryAttention"] == "yes"  # rotated in fp32 between Casts: matched


# ----------------------------------------------------------------------------- CUDA (the GPU machine)

def _cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_available(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")
@pytest.mark.parametrize("name", ["mistral-sw", "gemma2", "gemma3", "qwen3", "olmo2"])
def test_cuda_gqa_matches_the_cpu_graph(name, tmp_path):
    """fp16, lowered to GroupQueryAttention on CUDA: Mistral's window of 8 (local_window_size), Gemma 2's
    soft-capping, alternating windows and head size 256, Gemma 3's and Qwen 3's q/k norms. Logits against the
    same lowered graph on the CPU EP over a prefill past the window and decode steps (ORT's CUDA and CPU
    kernels must read softcap and local_window_size the same way), and 40 greedy tokens against the plain
    fp16 graph."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    src = cached_engine(BuildConfig(model=f"tiny:{name}", dtype="fp16"), progress=False)
    low = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=64, custom_ops=False), tmp_path / "engine",
                            source=src, progress=False)
    cuda = open_gqa_engine(low, device="cuda", max_batch=1).engine
    cpu = open_gqa_engine(low, device="cpu", max_batch=1).engine
    same_fp16_logits(cuda, cpu)
    prompt = _prompts(cpu.vocab, seed=1)[0]
    plain = open_engine(src, device="cpu").engine
    assert ort_greedy(cuda, [prompt], 40)[0] == ort_greedy(plain, [prompt], 40)[0]
