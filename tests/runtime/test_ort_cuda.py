"""runtime.engines.ort_cuda: the GQA engine (shared KV buffer, fixed bindings, device sampling) on the CPU EP
here, and on CUDA with CUDA graphs where onnxruntime-gpu and a GPU exist (marked `gpu`; they skip
elsewhere, saying why)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids
from enginesmith.runtime.decoding.sampling import SamplingParams, probabilities


def _cuda_available() -> bool:
    import onnxruntime as ort

    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


gpu = pytest.mark.skipif(not _cuda_available(),
                         reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")


@pytest.fixture(scope="module")
def lowered(tmp_path_factory):
    """Engine dirs: tiny llama fp32 and fp16, each lowered for the GQA engine (capacity 128)."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    out = {}
    for dtype in ("fp32", "fp16"):
        src = cached_engine(BuildConfig(model="tiny:llama", dtype=dtype), progress=False)
        out[dtype] = (src, build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=128, custom_ops=False),
                                             tmp_path_factory.mktemp(dtype) / "engine", source=src,
                                             progress=False))  # the ops: tests/plugins
    return out


def _plain(src, prompts, config, device="cpu"):
    from enginesmith.runtime.load import open_engine

    engine = open_engine(src, device=device, threads=1).engine
    return [ids.tolist() for ids, _ in generate_ids(engine, prompts, config)]


PROMPTS = [[5, 6, 7, 8, 9, 5, 6], [11, 12, 13]]


def test_manifest_and_open(lowered):
    from enginesmith.runtime.engines.ort_cuda import GqaEngine, open_gqa_engine

    loaded = open_gqa_engine(lowered["fp32"][1], device="cpu", max_batch=2)
    assert isinstance(loaded.engine, GqaEngine)
    assert loaded.manifest.kv_layout.as_dict() == {"type": "dense", "io": "gqa-shared-buffer", "capacity": 128}
    assert any(p.startswith("lower_gqa") for p in loaded.manifest.passes)
    assert loaded.engine.kv.shape == (2, 2, 2, 2, 128, 16)  # one buffer: [L, K|V, B, Hkv, C, D]


def test_fast_generate_greedy_matches_plain_generate(lowered):
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    src, low = lowered["fp32"]
    config = GenerationConfig(max_new_tokens=24)
    engine = open_gqa_engine(low, device="cpu", max_batch=2).engine
    fast = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
    assert fast == _plain(src, PROMPTS, config)
    generic = [ids.tolist() for ids, _ in generate_ids(engine, PROMPTS, config)]  # left-padded batch
    assert generic == fast


def test_speculative_on_the_gqa_engine_is_lossless(lowered):
    """Rollback on the shared buffer is a length change; greedy output is unchanged by speculation."""
    from enginesmith.runtime.decoding import speculative as sp
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    src, low = lowered["fp32"]
    engine = open_gqa_engine(low, device="cpu").engine
    config = GenerationConfig(max_new_tokens=30)
    for prompt in PROMPTS:
        stats = sp.SpeculativeStats()
        out = list(sp.speculative_tokens(engine, sp.NgramDrafter(), prompt, config, sp.SpeculativeConfig(k=4), stats))
        assert out == [row[0] for row in _plain(src, [prompt], config)]
        assert stats.proposed > 0


def test_device_sampler_draws_from_the_processed_distribution():
    """sample_on_device (argmax of probs / Exp noise) has sampling.probabilities' distribution:
    chi-square goodness of fit, seeded, false-alarm rate 1e-3."""
    from enginesmith.runtime.engines.ort_cuda import sample_on_device

    logits = torch.tensor(np.random.default_rng(0).normal(0, 1.5, (1, 12)), dtype=torch.float32)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9, repetition_penalty=1.4)
    seen = torch.zeros(1, 12, dtype=torch.bool)
    seen[0, [1, 3]] = True
    expected = probabilities(logits.numpy(), params, [np.array([1, 3])])[0]
    gen = torch.Generator().manual_seed(0)
    n = 20000
    draws = sample_on_device(logits.expand(n, 12), params, gen, seen.expand(n, 12)).numpy()
    counts = np.bincount(draws, minlength=12)
    assert counts[expected == 0].sum() == 0
    keep = expected > 0
    stat = float((((counts - n * expected) ** 2)[keep] / (n * expected[keep])).sum())
    p_value = float(torch.special.gammaincc(torch.tensor((keep.sum() - 1) / 2.0), torch.tensor(stat / 2)))
    assert p_value > 1e-3
    greedy = sample_on_device(logits, SamplingParams(), None, None)
    assert int(greedy[0]) == int(np.argmax(logits.numpy()))


def test_capacity_and_batch_limits(lowered):
    from enginesmith.runtime.engines.ort_cuda import GqaEngine, fast_generate_ids

    engine = GqaEngine(lowered["fp32"][1] / "model.onnx", device="cpu", max_batch=1, capacity=16)
    with pytest.raises(UserError, match="batch 2"):
        engine.new_cache(2)
    with pytest.raises(UserError, match="does not fit"):
        list(fast_generate_ids(engine, [list(range(16))], GenerationConfig(max_new_tokens=4)))
    with pytest.raises(UserError, match="exceeds"):
        GqaEngine(lowered["fp32"][1] / "model.onnx", device="cpu", capacity=4096)


def test_plain_graph_is_refused(lowered):
    from enginesmith.runtime.engines.ort_cuda import GqaEngine

    with pytest.raises(UserError, match="not a GQA-lowered graph"):
        GqaEngine(lowered["fp32"][0] / "model.onnx", device="cpu")


# ----------------------------------------------------------------------------- on the GPU

@pytest.mark.gpu
@gpu
def test_cuda_graph_decode_matches_eager_cuda(lowered):
    """fp16 on CUDA: decode with CUDA graphs (captured by torch around ORT's Run, or by ORT itself)
    gives the tokens the same engine gives without graphs, and the step was captured and replayed."""
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    config = GenerationConfig(max_new_tokens=40)
    outs = {}
    for mode in ("none", "ort", "torch"):
        engine = open_gqa_engine(lowered["fp16"][1], device="cuda", max_batch=2, cuda_graph=mode).engine
        outs[mode] = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
        if mode != "none":
            assert max(step.runs for step in engine._steps.values()) > 3
        if mode == "torch":
            assert any(step.graph is not None for step in engine._steps.values())
    assert outs["torch"] == outs["none"] and outs["ort"] == outs["none"]


@pytest.mark.gpu
@gpu
def test_cuda_matches_cpu_reference_and_speculation(lowered):
    """The fp16 graph on CUDA (GQA's CUDA kernels are fp16/bf16 only) follows the same graph on
    the CPU EP (fp16 rounding may flip a near-tie, rarely); speculation is lossless on CUDA."""
    from enginesmith.runtime.decoding import speculative as sp
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    low = lowered["fp16"][1]
    config = GenerationConfig(max_new_tokens=24)
    engine = open_gqa_engine(low, device="cuda", max_batch=2).engine
    cpu = open_gqa_engine(low, device="cpu", max_batch=2).engine
    got = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
    ref = [ids.tolist() for ids, _ in fast_generate_ids(cpu, PROMPTS, config)]
    assert sum(a == b for a, b in zip(got, ref)) >= 0.9 * len(ref)
    stats = sp.SpeculativeStats()
    out = list(sp.speculative_tokens(engine, sp.NgramDrafter(), PROMPTS[0], config, sp.SpeculativeConfig(k=4), stats))
    assert out == [row[0] for row in got]


@pytest.mark.gpu
@gpu
def test_sampling_on_cuda_is_seeded(lowered):
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    engine = open_gqa_engine(lowered["fp16"][1], device="cuda").engine
    config = GenerationConfig(max_new_tokens=16, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=3))
    a = [ids.tolist() for ids, _ in fast_generate_ids(engine, [PROMPTS[0]], config)]
    b = [ids.tolist() for ids, _ in fast_generate_ids(engine, [PROMPTS[0]], config)]
    assert a == b


@pytest.mark.parametrize("vocab", [128256, 49152, 97, 1000])
def test_two_stage_argmax_matches_argmax_with_ties(vocab):
    """device_argmax (max per chunk of the vocabulary, then argmax of the chunk maxima) returns
    argmax's index, the first one on ties, for fp16 rows with repeated maxima."""
    from enginesmith.runtime.engines.ort_cuda import device_argmax

    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=gen).half()
    logits[1, [5, vocab // 2, vocab - 1]] = 9.0          # ties across chunks
    logits[2, [vocab - 2, vocab - 1]] = 9.0              # ties in the last chunk
    logits[3] = 0.0                                      # all equal: index 0
    logits[4, vocab - 1] = 9.0
    assert torch.equal(device_argmax(logits), logits.argmax(-1))
    assert torch.equal(device_argmax(logits[:, None, :]), logits[:, None, :].argmax(-1))


@pytest.mark.gpu
@gpu
def test_engine_interface_on_cuda_matches_the_device_loop(lowered):
    """generate_ids over GqaEngine.forward (what `enginesmith run` streams with) on CUDA, with the
    captured decode step, gives the device loop's tokens: the logits are copied to the host only
    after the step that wrote them (a copy on another stream once read the previous step's)."""
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    config = GenerationConfig(max_new_tokens=32)
    engine = open_gqa_engine(lowered["fp16"][1], device="cuda", max_batch=2).engine
    fast = [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, config)]
    plain = [ids.tolist() for ids, _ in generate_ids(engine, PROMPTS, config)]
    assert plain == fast
