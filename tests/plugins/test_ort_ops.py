"""libenginesmith_ort_ops.so (plugins/ort_ops) and the ort_gemv pass.

CPU (here and in CI): each op's CPU kernel against numpy (and GemvQ4 against ORT's own MatMulNBits on
the same packed weights), bad inputs, and the pass on tiny engines (greedy output unchanged).
GPU (marked gpu): the CUDA kernels against the CPU kernels, for decode and prefill-sized calls, and
a CUDA-graph GQA engine with the ops against the same engine without them.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402


def _cuda_ort() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()


gpu = pytest.mark.skipif(not _cuda_ort(), reason="needs onnxruntime-gpu and a CUDA GPU (run on the device machine)")


def _pack(q: np.ndarray, bs: int) -> np.ndarray:
    """uint4 values q [N, K] (0..15) -> MatMulNBits' uint8 [N, K/bs, bs/2], low nibble first."""
    n, k = q.shape
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(n, k // bs, bs // 2)


def _weights(rng, n, k, bs):
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float16)
    q = rng.integers(0, 16, (n, k)).astype(np.uint8)
    s = (rng.random((n, k // bs)) * 0.02 + 0.001).astype(np.float16)
    deq = (q.astype(np.float32) - 8) * np.repeat(s.astype(np.float32), bs, axis=1)
    return w, q, s, deq


def _model(nodes, inits, x_shape):
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT16, x_shape)],
        [helper.make_tensor_value_info(n.output[0], T.FLOAT16 if n.op_type != "MatMulNBits" else T.FLOAT16, None)
         for n in nodes],
        [numpy_helper.from_array(a, name) for name, a in inits.items()])
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1), helper.make_opsetid("com.microsoft", 1)])


def _ops_graph(rng, m_shape, n, k, bs):
    w, q, s, deq = _weights(rng, n, k, bs)
    wu, qu, su, dequ = _weights(rng, n, k, bs)
    E = "com.enginesmith"
    q4 = dict(K=k, N=n, block_size=bs)
    nodes = [helper.make_node("Gemv", ["x", "w"], ["gemv"], domain=E),
             helper.make_node("SwiGluGemv", ["x", "w", "wu"], ["swiglu"], domain=E),
             helper.make_node("GemvQ4", ["x", "b", "s"], ["gemv_q4"], domain=E, **q4),
             helper.make_node("SwiGluGemvQ4", ["x", "b", "s", "bu", "su"], ["swiglu_q4"], domain=E, **q4),
             # its own copy of the weights: ORT CUDA's MatMulNBits prepacks (and may release) what it reads
             helper.make_node("MatMulNBits", ["x", "b_nbits", "s_nbits"], ["nbits"], domain="com.microsoft", bits=4,
                              **q4)]
    inits = {"w": w, "wu": wu, "b": _pack(q, bs), "s": s.reshape(-1), "bu": _pack(qu, bs), "su": su.reshape(-1),
             "b_nbits": _pack(q, bs), "s_nbits": s.reshape(-1)}
    refs = dict(w=w.astype(np.float32), wu=wu.astype(np.float32), deq=deq, dequ=dequ)
    return _model(nodes, inits, list(m_shape) + [k]), refs


_STREAMS = []


def _session(model, ops_lib, cuda=False):
    """A CPU session, or with cuda="user" a CUDA one on a user compute stream (as GqaEngine runs), with
    cuda="ort" on ORT's own stream (as OrtEngine runs)."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.register_custom_ops_library(str(ops_lib))
    providers = ["CPUExecutionProvider"]
    if cuda:
        import torch

        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        options = {"device_id": 0}
        if cuda == "user":
            _STREAMS.append(torch.cuda.Stream())  # kept alive for the session's lifetime
            options["user_compute_stream"] = str(_STREAMS[-1].cuda_stream)
        providers = [("CUDAExecutionProvider", options)]
    return ort.InferenceSession(model.SerializeToString(), opts, providers=providers)


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("m_shape", [(1, 1), (1, 3), (2, 6)])
def test_cpu_kernels_match_numpy_and_matmulnbits(ops_lib, m_shape):
    rng = np.random.default_rng(0)
    model, r = _ops_graph(rng, m_shape, n=40, k=128, bs=32)
    x = rng.standard_normal(m_shape + (128,)).astype(np.float16)
    gemv, swiglu, gemv_q4, swiglu_q4, nbits = _session(model, ops_lib).run(None, {"x": x})
    xf = x.astype(np.float32)
    assert gemv.shape == m_shape + (40,) and gemv.dtype == np.float16
    np.testing.assert_allclose(gemv, xf @ r["w"].T, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(swiglu, _silu(xf @ r["w"].T) * (xf @ r["wu"].T), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(gemv_q4, xf @ r["deq"].T, rtol=2e-3, atol=2e-2)
    np.testing.assert_allclose(gemv_q4.astype(np.float32), nbits.astype(np.float32), rtol=2e-3, atol=2e-2)
    np.testing.assert_allclose(swiglu_q4, _silu(xf @ r["deq"].T) * (xf @ r["dequ"].T), rtol=5e-3, atol=5e-2)


EPS = 0.25  # large, so a misread epsilon shows in the result


def _norm_graph(rng, m_shape, n, k, bs):
    """Every RmsNorm / SkipRmsNorm op on x (and skip), with numpy's view of the same weights."""
    w, q, s, deq = _weights(rng, n, k, bs)
    wu, qu, su, dequ = _weights(rng, n, k, bs)
    gamma = (rng.random(k) + 0.5).astype(np.float16)
    E = "com.enginesmith"
    q4 = dict(K=k, N=n, block_size=bs)
    weights = {"Gemv": ["w"], "SwiGluGemv": ["w", "wu"], "GemvQ4": ["b", "s"], "SwiGluGemvQ4": ["b", "s", "bu", "su"]}
    nodes, outputs = [], []
    for prefix, norm_in in (("RmsNorm", ["x", "gamma"]), ("SkipRmsNorm", ["x", "skip", "gamma"])):
        for base, ws in weights.items():
            op = prefix + base
            outs = [op] + ([f"{op}_sum"] if prefix == "SkipRmsNorm" else [])
            nodes.append(helper.make_node(op, norm_in + ws, outs, domain=E, epsilon=EPS,
                                          **(q4 if base.endswith("Q4") else {})))
            outputs += outs
    inits = {"w": w, "wu": wu, "b": _pack(q, bs), "s": s.reshape(-1), "bu": _pack(qu, bs), "su": su.reshape(-1),
             "gamma": gamma}
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(v, T.FLOAT16, list(m_shape) + [k]) for v in ("x", "skip")],
        [helper.make_tensor_value_info(o, T.FLOAT16, None) for o in outputs],
        [numpy_helper.from_array(a, name) for name, a in inits.items()])
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(E, 1)])
    refs = dict(Gemv=[w.astype(np.float32)], SwiGluGemv=[w.astype(np.float32), wu.astype(np.float32)],
                GemvQ4=[deq], SwiGluGemvQ4=[deq, dequ])
    return model, refs, gamma, outputs


def _rms_norm(s, gamma):
    """The ops' norm (plugins/ort_ops/gemv.h): fp32 sum and mean, the sum rounded to fp16 first."""
    sh = s.astype(np.float16).astype(np.float32)
    rstd = 1 / np.sqrt((s * s).mean(-1, keepdims=True) + EPS)
    return (sh * rstd * gamma.astype(np.float32)).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("m_shape", [(1, 1), (2, 3)])
def test_norm_ops_match_numpy(ops_lib, m_shape):
    rng = np.random.default_rng(2)
    model, refs, gamma, names = _norm_graph(rng, m_shape, n=24, k=64, bs=32)
    x = (rng.standard_normal(m_shape + (64,)) * 3).astype(np.float16)
    skip = rng.standard_normal(m_shape + (64,)).astype(np.float16)
    got = dict(zip(names, _session(model, ops_lib).run(None, {"x": x, "skip": skip})))
    for prefix, s in (("RmsNorm", x.astype(np.float32)), ("SkipRmsNorm", x.astype(np.float32) + skip)):
        xn = _rms_norm(s, gamma)
        for base, ws in refs.items():
            want = xn @ ws[0].T if len(ws) == 1 else _silu(xn @ ws[0].T) * (xn @ ws[1].T)
            atol = 2e-2 if base.endswith("Q4") else 2e-3
            np.testing.assert_allclose(got[prefix + base], want, rtol=5e-3, atol=atol, err_msg=prefix + base)
            if prefix == "SkipRmsNorm":
                np.testing.assert_array_equal(got[f"{prefix}{base}_sum"], s.astype(np.float16))


def test_bad_inputs_are_named(ops_lib):
    rng = np.random.default_rng(1)
    _, q, s, _ = _weights(rng, 16, 64, 32)
    bad_k = _model([helper.make_node("GemvQ4", ["x", "b", "s"], ["y"], domain="com.enginesmith", K=96, N=16,
                                     block_size=32)], {"b": _pack(q, 32), "s": s.reshape(-1)}, [1, 64])
    with pytest.raises(Exception, match="GemvQ4: x has K = 64, the node says 96"):
        _session(bad_k, ops_lib).run(None, {"x": np.zeros((1, 64), np.float16)})
    w = np.zeros((16, 48), np.float16)
    bad_w = _model([helper.make_node("Gemv", ["x", "w"], ["y"], domain="com.enginesmith")], {"w": w}, [1, 64])
    with pytest.raises(Exception, match=r"weights must be float16 \[N, K\] with K = 64"):
        _session(bad_w, ops_lib).run(None, {"x": np.zeros((1, 64), np.float16)})
    bad_gamma = _model([helper.make_node("RmsNormGemv", ["x", "g", "w"], ["y"], domain="com.enginesmith", epsilon=1e-5)],
                       {"g": np.ones(32, np.float16), "w": np.zeros((16, 64), np.float16)}, [1, 64])
    with pytest.raises(Exception, match=r"RmsNormGemv: gamma must be float16 \[K\] with K = 64"):
        _session(bad_gamma, ops_lib).run(None, {"x": np.zeros((1, 64), np.float16)})
    no_eps = _model([helper.make_node("RmsNormGemv", ["x", "g", "w"], ["y"], domain="com.enginesmith")],
                    {"g": np.ones(64, np.float16), "w": np.zeros((16, 64), np.float16)}, [1, 64])
    with pytest.raises(Exception, match="epsilon"):
        _session(no_eps, ops_lib).run(None, {"x": np.zeros((1, 64), np.float16)})


@pytest.fixture(scope="module")
def tiny_engines(ops_lib, tmp_path_factory):
    """Tiny llama fp16 (head size 64: the attention op applies), lowered for the GQA engine with and
    without the custom ops (fp16, w4a16)."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    out = {}
    for quant in (None, "w4a16"):
        for ops in (False, True):
            out[quant, ops] = build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=128,
                                                quant=(quant) and "w4a16-rtn", block_size=32,
                                                quantize_lm_head=quant is not None, custom_ops=ops,
                                                custom_attention=ops), tmp_path_factory.mktemp("ortgemv") / "engine",
                                                source=src, progress=False)
    return out


PROMPTS = [[5, 6, 7, 8, 9, 5, 6], [11, 12, 13]]


def _greedy(engine_dir, device, n=24):
    from enginesmith.runtime.decoding.generate import GenerationConfig
    from enginesmith.runtime.engines.ort_cuda import fast_generate_ids, open_gqa_engine

    engine = open_gqa_engine(engine_dir, device=device, max_batch=2).engine
    return [ids.tolist() for ids, _ in fast_generate_ids(engine, PROMPTS, GenerationConfig(max_new_tokens=n))]


@pytest.mark.parametrize("quant", [None, "w4a16"])
def test_pass_rewrites_every_linear_and_keeps_greedy_output(tiny_engines, quant):
    import json

    manifest = json.loads((tiny_engines[quant, True] / "build.json").read_text())
    counts = manifest["pass_counts"]["ort_gemv"]
    # tiny llama: 2 layers x (qkv, o, gate, up, down) + lm_head = 11 products, 2 SwiGLUs.
    # 5 RMSNorms (2 per layer, the final one) folded into the products after them.
    assert counts == ({"gemv": 11, "gemv_q4": 0, "swiglu": 2, "norm": 5} if quant is None else
                      {"gemv": 0, "gemv_q4": 11, "swiglu": 2, "norm": 5})
    assert manifest["pass_counts"]["ort_attention"] == {"attention": 2}
    nodes = onnx.load(str(tiny_engines[quant, True] / "model.onnx")).graph.node
    ops = {n.op_type for n in nodes}
    assert not ops & {"FusedMatMul", "MatMulNBits", "Sigmoid", "SkipSimplifiedLayerNormalization", "RMSNormalization"}
    assert {n.domain for n in nodes if n.op_type == "GroupQueryAttention"} == {"com.enginesmith"}
    q4 = "Q4" if quant else ""
    assert {f"RmsNormGemv{q4}", f"SkipRmsNormSwiGluGemv{q4}", f"SkipRmsNormGemv{q4}"} <= ops
    want = _greedy(tiny_engines[quant, False], "cpu")
    if quant is None:
        assert _greedy(tiny_engines[quant, True], "cpu") == want
    # int4: the ops' fp32 sums against MatMulNBits' order can flip this random model's near-ties, so
    # the check is on logits, teacher-forced on the plain engine's greedy tokens
    for prompt, follow in zip(PROMPTS, want):
        a, b = (_teacher_forced_logits(tiny_engines[quant, ops], "cpu", prompt, follow) for ops in (False, True))
        assert np.abs(a - b).max() <= 1e-2 * float(np.abs(a).max()), float(np.abs(a - b).max())


def test_engine_without_the_library_names_it(tiny_engines, monkeypatch, tmp_path):
    from enginesmith.core.errors import UserError
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    monkeypatch.setenv("ENGINESMITH_ORT_OPS_LIB", str(tmp_path / "missing.so"))
    with pytest.raises(UserError, match="ops library is not built"):
        open_gqa_engine(tiny_engines[None, True], device="cpu")


OPS_OUTPUTS = ("gemv", "swiglu", "gemv_q4", "swiglu_q4", "nbits")  # _ops_graph's outputs


def _cuda_matches_cpu(ops_lib, model, feeds, names, stream):
    """Every output of `model` on CUDA (`stream`: the user's or ORT's) within 4e-3 of its scale of the CPU kernels'."""
    want = _session(model, ops_lib).run(None, feeds)
    got = _session(model, ops_lib, cuda=stream).run(None, feeds)
    for name, a, b in zip(names, got, want):
        a, b = a.astype(np.float32), b.astype(np.float32)
        scale = max(1.0, float(np.abs(b).max()))
        assert np.abs(a - b).max() <= 4e-3 * scale, (name, float(np.abs(a - b).max()), scale)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 20])
@pytest.mark.parametrize("n,k,bs", [(2048, 2048, 128), (1000, 512, 32), (3072, 8192, 64)])
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_kernels_match_cpu_kernels(ops_lib, m, n, k, bs, stream):
    rng = np.random.default_rng(m)
    model, _ = _ops_graph(rng, (1, m), n=n, k=k, bs=bs)
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    _cuda_matches_cpu(ops_lib, model, {"x": x}, OPS_OUTPUTS, stream)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("n,k,bs", [(2048, 2048, 128), (1000, 512, 32), (512, 16384, 64)])
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_norm_ops_match_cpu_kernels(ops_lib, m, n, k, bs, stream):
    """The folded norms on the GPU (in the GEMV kernel, or before cuBLAS from 5 rows on) vs the CPU."""
    rng = np.random.default_rng(m + 7)
    model, _, _, names = _norm_graph(rng, (1, m), n=n, k=k, bs=bs)
    feeds = {"x": (rng.standard_normal((1, m, k)) * 3).astype(np.float16),
             "skip": rng.standard_normal((1, m, k)).astype(np.float16)}
    _cuda_matches_cpu(ops_lib, model, feeds, names, stream)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 8, 16, 20, 33, 64])
@pytest.mark.parametrize("n,k,bs", [(2048, 2048, 128), (1000, 512, 32), (3072, 8192, 64)])
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_int4_tensor_core_path_matches_cpu_kernels(ops_lib, monkeypatch, m, n, k, bs, stream):
    """ES_Q4_MMA=1: int4 products of 5..64 rows on tensor cores (plugins/ort_ops/gemm_q4.cu, split-K, the
    weights dequantized in registers), plain and SwiGLU, against the CPU kernels."""
    monkeypatch.setenv("ES_Q4_MMA", "1")
    rng = np.random.default_rng(m + 100)
    model, _ = _ops_graph(rng, (1, m), n=n, k=k, bs=bs)
    x = rng.standard_normal((1, m, k)).astype(np.float16)
    _cuda_matches_cpu(ops_lib, model, {"x": x}, OPS_OUTPUTS, stream)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [5, 17, 64])
@pytest.mark.parametrize("n,k,bs", [(2048, 2048, 128), (512, 16384, 64)])
def test_cuda_int4_tensor_core_path_with_folded_norms(ops_lib, monkeypatch, m, n, k, bs):
    """ES_Q4_MMA=1 with the norm ops: the norm kernel, then the tensor-core product from its rows."""
    monkeypatch.setenv("ES_Q4_MMA", "1")
    rng = np.random.default_rng(m + 200)
    model, _, _, names = _norm_graph(rng, (1, m), n=n, k=k, bs=bs)
    feeds = {"x": (rng.standard_normal((1, m, k)) * 3).astype(np.float16),
             "skip": rng.standard_normal((1, m, k)).astype(np.float16)}
    _cuda_matches_cpu(ops_lib, model, feeds, names, "ort")


def _teacher_forced_logits(engine_dir, device, prompt, follow):
    """Logits of a prefill of `prompt`, then of one decode step per token of `follow` (fp32, host)."""
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    engine = open_gqa_engine(engine_dir, device=device).engine
    cache = engine.new_cache(1)
    ids = np.array([prompt])
    out = [engine.forward(ids, np.ones_like(ids), None, cache)[0]]
    for t in follow:
        out.append(engine.forward(np.array([[t]]), np.ones((1, 1), np.int64), None, cache)[0])
    return np.concatenate(out)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("quant", [None, "w4a16"])
@pytest.mark.parametrize("prompt_len", [7, 21])  # a captured step (M = 7) / a plain prefill run (M = 21)
def test_cuda_graph_engine_with_ops_matches_without(tiny_engines, quant, prompt_len):
    """Decode through CUDA graphs (the ops on ORT's stream, captured and replayed) gives the plain
    engine's logits, teacher-forced on the same tokens."""
    rng = np.random.default_rng(prompt_len)
    prompt = rng.integers(3, 200, prompt_len).tolist()
    follow = rng.integers(3, 200, 30).tolist()
    want = _teacher_forced_logits(tiny_engines[quant, False], "cuda", prompt, follow)
    got = _teacher_forced_logits(tiny_engines[quant, True], "cuda", prompt, follow)
    assert got.shape == want.shape == (prompt_len + 30, want.shape[-1])
    scale = float(np.abs(want).max())
    assert np.abs(got - want).max() <= 2e-2 * scale, (float(np.abs(got - want).max()), scale)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
def test_cuda_int4_gemv_keeps_large_activations_finite(ops_lib, m):
    """The int4 GEMV sums 32 products in fp16 (x·(q-8)/16): activations in the thousands (the MLP's
    down projection sees such outliers) stay in range and match the CPU kernel."""
    rng = np.random.default_rng(11)
    n, k, bs = 1024, 8192, 128
    _, q, s, _ = _weights(rng, n, k, bs)
    node = helper.make_node("GemvQ4", ["x", "b", "s"], ["y"], domain="com.enginesmith", K=k, N=n, block_size=bs)
    model = _model([node], {"b": _pack(q, bs), "s": s.reshape(-1)}, [1, m, k])
    x = np.clip(rng.standard_normal((1, m, k)) * 600, -3000, 3000).astype(np.float16)
    want = _session(model, ops_lib).run(None, {"x": x})[0].astype(np.float32)
    got = _session(model, ops_lib, cuda="ort").run(None, {"x": x})[0].astype(np.float32)
    assert np.isfinite(want).all() and np.isfinite(got).all()
    assert np.abs(got - want).max() <= 4e-3 * float(np.abs(want).max()), (float(np.abs(got - want).max()), float(np.abs(want).max()))


def test_pass_rejects_what_the_ops_cannot_take_with_the_reason():
    """Sites the rules cannot take stay as they are and are reported (node, reason); the others are
    rewritten and counted. Only the graph rewrite runs here: no library needed."""
    import onnx_ir as ir

    from enginesmith.passes.lower.ort_gemv import ort_gemv

    rng = np.random.default_rng(0)
    ms = "com.microsoft"
    w = (rng.standard_normal((16, 64)) * 0.05).astype(np.float16)
    nodes = [helper.make_node("FusedMatMul", ["x", "w"], ["ok"], "ok", domain=ms, transB=1),
             helper.make_node("FusedMatMul", ["x", "w"], ["no_trans"], "no_trans", domain=ms, transA=1, transB=1),
             helper.make_node("FusedMatMul", ["x12", "w12"], ["k12"], "k12", domain=ms, transB=1),
             helper.make_node("RMSNormalization", ["x", "g"], ["normed"], "norm", axis=-1),
             helper.make_node("FusedMatMul", ["normed", "w"], ["after_norm"], "after_norm", domain=ms, transB=1),
             helper.make_node("Relu", ["normed"], ["other_reader"], "relu")]
    proto = _model(nodes, {"w": w, "w12": w[:, :12].copy(), "g": np.ones(64, np.float16)}, [1, 64])
    proto.graph.input.append(helper.make_tensor_value_info("x12", T.FLOAT16, [1, 12]))
    proto.graph.value_info.append(helper.make_tensor_value_info("normed", T.FLOAT16, [1, 64]))
    model = ir.from_proto(proto)
    result = ort_gemv(model)
    assert result.counts == {"gemv": 2, "gemv_q4": 0, "swiglu": 0, "norm": 0}
    reasons = {r.node: r.reason for r in result.skipped}
    assert reasons["no_trans"].startswith("not x @ W^T")
    assert reasons["k12"] == "K = 12 is not a multiple of 8"
    assert reasons["after_norm_gemv"] == "the normalized x is also read elsewhere"
    assert len(result.skipped) == 3
    ops = [(n.name, n.op_type) for n in model.graph]
    assert ("no_trans", "FusedMatMul") in ops and ("k12", "FusedMatMul") in ops
    assert ("ok_gemv", "Gemv") in ops and ("norm", "RMSNormalization") in ops
