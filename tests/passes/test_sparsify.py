"""sparsify: 2:4 pruning by magnitude and by Wanda, the profitability gate, the lowerings (dense on
ONNX Runtime, SparseGemm24 plugin nodes for TensorRT) and the SparseGemm24 reference's checks.
The accuracy comparison on real weights (SmolLM2, Wanda < magnitude) is benchmarks/sparsity/."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest

from enginesmith.core.errors import UserError
from enginesmith.passes.machinery.registry import PassContext
from enginesmith.passes.quant.sparsify import (
    SparsifyParams,
    channel_norms,
    check_24,
    lower_sparse_graph,
    prune_24,
    sparse_gemm24_reference,
    sparsify,
)

VOCAB = 49152


def is_24(w_nk: np.ndarray) -> bool:
    n, k = w_nk.shape
    return bool((np.count_nonzero(w_nk.reshape(n, k // 4, 4), axis=-1) <= 2).all())


@pytest.fixture(scope="module")
def calib():
    from enginesmith.passes import from_tokens

    tokens = np.random.default_rng(0).integers(0, VOCAB, size=4 * 32 + 7)
    return from_tokens(tokens, "random:test", samples=4, seq_len=32)


@pytest.fixture
def private_cache(tmp_path, monkeypatch, tiny_engine):
    """Calibration statistics go to a temp dir (the engines stay in the user's cache)."""
    for family in ("llama", "qwen2"):
        tiny_engine(family)
    monkeypatch.setenv("ENGINESMITH_CACHE", str(tmp_path / "cache"))


def weights(model: ir.Model) -> dict[str, np.ndarray]:
    """[N, K] weight of every MatMul with a constant (or constant-transposed) weight, by node name."""
    out = {}
    for node in model.graph:
        if node.op_type != "MatMul":
            continue
        w = node.inputs[1]
        if w.const_value is not None:
            out[node.name] = w.const_value.numpy().astype(np.float32).T
        elif w.producer() is not None and w.producer().op_type == "Transpose":
            src = w.producer().inputs[0]
            if src.const_value is not None:
                out[node.name] = src.const_value.numpy().astype(np.float32)
    return out


def test_prune_24_magnitude_equals_the_plugin_reference():
    import torch

    from enginesmith.plugins import reference

    w = np.random.default_rng(0).standard_normal((32, 64)).astype(np.float32)
    pruned = prune_24(w, np.abs(w))
    assert is_24(pruned) and np.count_nonzero(pruned) == w.size // 2
    np.testing.assert_array_equal(pruned, reference.prune_24_magnitude(torch.from_numpy(w)).numpy())
    check_24(pruned)


def test_wanda_weighs_weights_by_activation_norms():
    """Every 4th input channel carries large activations: Wanda keeps most of their small weights,
    magnitude drops most of them, and Wanda's layer output error on those activations is lower."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 64)).astype(np.float32)
    x[:, ::4] *= 20.0                                          # outlier channels 0, 4, 8, ...
    w = rng.standard_normal((48, 64)).astype(np.float32)
    w[:, ::4] *= 0.1                                           # ... whose weights are small
    norms = channel_norms(x)
    assert norms[0] > 10 * norms[1]
    magnitude, wanda = prune_24(w, np.abs(w)), prune_24(w, np.abs(w) * norms[None, :])
    outliers = w.shape[0] * 16                                 # weights on the outlier channels
    assert is_24(wanda) and np.count_nonzero(wanda[:, ::4]) > 0.6 * outliers
    assert np.count_nonzero(magnitude[:, ::4]) < 0.2 * outliers
    err = {name: float(np.linalg.norm(x @ (w - p).T)) for name, p in (("magnitude", magnitude), ("wanda", wanda))}
    assert err["wanda"] < 0.5 * err["magnitude"], err


def test_sparse_reference_refuses_a_non_24_weight():
    rng = np.random.default_rng(2)
    w = prune_24(rng.standard_normal((4, 16)), np.ones((4, 16)))
    x = rng.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(sparse_gemm24_reference(x, w), x @ w.T.astype(np.float32), rtol=1e-6)
    bad = w.copy()
    bad[1, 4:8] = [1.0, 2.0, 3.0, 0.0]
    bad[3, 12:16] = 1.0
    with pytest.raises(UserError, match=r"not 2:4 sparse: row 1, columns 4\.\.7 hold more than 2 nonzeros "
                                        r"\(2 bad groups of 4 in all\)"):
        sparse_gemm24_reference(x, bad)
    with pytest.raises(UserError, match="in_features 6 is not a multiple of 4"):
        check_24(np.ones((2, 6)))
    with pytest.raises(UserError, match="x has 8 features"):
        sparse_gemm24_reference(x[:, :8], w)


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_sparsify_prunes_every_linear_but_the_lm_head(method, tiny_engine, calib, tmp_path, private_cache):
    from enginesmith.passes.manager.pipeline import run_pipeline
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    src = tiny_engine("llama") / "model.onnx"
    dst = tmp_path / method / "model.onnx"
    (report,) = run_pipeline(src, dst, f"sparsify:method={method},only_profitable=false", calibration=calib,
                             progress=False)
    assert report["counts"] == {"pruned_24": 14, "kept_dense_unprofitable": 0, "skipped": 1}
    assert "lm_head" in report["skipped"][0]["reason"] and not report["exact"]
    before, after = weights(ir.load(src)), weights(ir.load(dst))
    lm_head = [n for n, w in before.items() if w.shape[0] == VOCAB]
    assert len(lm_head) == 1 and len(after) == len(before) == 15
    for name, w in after.items():
        if w.shape[0] == VOCAB:
            np.testing.assert_array_equal(w, before[lm_head[0]])
        else:
            assert is_24(w) and np.count_nonzero(w) == w.size // 2, name
    meta = json.loads(ir.load(dst).metadata_props["enginesmith.sparsity"])
    assert meta["method"] == method and len(meta["layers"]) == 14
    ids = np.array([[5, 6, 7, 8]])
    dense = OrtEngine(src, device="cpu", threads=1).forward(ids, np.ones_like(ids), np.arange(4)[None],
                                                             OrtEngine(src, device="cpu").new_cache(1))
    engine = OrtEngine(dst, device="cpu", threads=1)
    pruned = engine.forward(ids, np.ones_like(ids), np.arange(4)[None], engine.new_cache(1))
    assert np.isfinite(pruned).all() and np.abs(pruned - dense).max() > 1e-3  # lossy, and runs


def test_wanda_and_magnitude_choose_different_weights(tiny_engine, calib, private_cache):
    src = tiny_engine("llama") / "model.onnx"
    chosen = {}
    for method in ("magnitude", "wanda"):
        model = ir.load(src)
        sparsify(model, SparsifyParams(method=method, only_profitable=False), PassContext(src, calib, False))
        chosen[method] = {n: w != 0 for n, w in weights(model).items()}
    differs = [n for n in chosen["wanda"] if (chosen["wanda"][n] != chosen["magnitude"][n]).any()]
    assert len(differs) >= 10, differs


def test_profitability_keeps_unprofitable_layers_dense(tiny_engine, tmp_path):
    src = tiny_engine("llama") / "model.onnx"
    model = ir.load(src)
    result = sparsify(model, SparsifyParams(method="magnitude"), None)     # the shipped table: 64x64 never pays
    assert result.counts == {"pruned_24": 0, "kept_dense_unprofitable": 14, "skipped": 1}
    assert all("sparse does not pay" in r.reason for r in result.skipped if "lm_head" not in r.reason)
    table = {"device": "test", "threshold": 1.05, "shapes": {"64x64": {"speedup_by_m": {"16": 1.5}, "min_m": 16},
                                                           "64x128": {"speedup_by_m": {"16": 0.5}, "min_m": None}}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    model = ir.load(src)
    result = sparsify(model, SparsifyParams(method="magnitude", profitability=str(path), tokens=16), None)
    # q, k, v, o, down are nearest to 64x64 (pays from 16 tokens); gate/up are 64x128 (never pays).
    assert result.counts["pruned_24"] == 10 and result.counts["kept_dense_unprofitable"] == 4
    small = sparsify(ir.load(src), SparsifyParams(method="magnitude", profitability=str(path), tokens=8), None)
    assert small.counts["pruned_24"] == 0                   # below min_m: decode-size GEMMs stay dense


def test_ir_op_lowered_for_ort_equals_the_direct_lowering(tiny_engine):
    src = tiny_engine("qwen2") / "model.onnx"                # q/k/v carry biases: Gemm-free, MatMul + Add
    direct, marked = ir.load(src), ir.load(src)
    params = dict(method="magnitude", only_profitable=False)
    sparsify(direct, SparsifyParams(**params), None)
    sparsify(marked, SparsifyParams(**params, lower="none"), None)
    assert sum(n.op_type == "SparseGemm24" and n.domain == "enginesmith" for n in marked.graph) == 14
    assert lower_sparse_graph(marked, "ort") == 14 and "enginesmith" not in marked.opset_imports
    a, b = weights(direct), weights(marked)
    assert sorted(map(str, (w.shape for w in a.values()))) == sorted(map(str, (w.shape for w in b.values())))
    for w in b.values():
        assert any(w.shape == v.shape and np.array_equal(w, v) for v in a.values())


def test_trt_lowering_writes_sparse_gemm_plugin_nodes(tmp_path):
    from enginesmith.builder import trt_lint
    from enginesmith.passes.manager.pipeline import run_pipeline
    from helpers.paged_graphs import h64_fp16_graph

    src = h64_fp16_graph()
    dst = tmp_path / "trt" / "model.onnx"
    (report,) = run_pipeline(src, dst, "sparsify:method=magnitude,only_profitable=false,lower=trt",
                             progress=False)  # magnitude pruning needs no calibration
    assert report["counts"]["pruned_24"] == 14
    model = ir.load(dst)
    nodes = [n for n in model.graph if n.op_type == "SparseGemm24"]
    assert len(nodes) == 14 and all(n.domain == "trt.plugins" for n in nodes)
    for node in nodes:
        attrs = node.attributes
        assert set(attrs) == {"weight", "out_features", "in_features", "plugin_version", "plugin_namespace"}
        w = attrs["weight"].value.numpy()
        assert w.dtype == np.float16 and w.shape == (attrs["out_features"].value, attrs["in_features"].value)
        assert is_24(w) and len(node.inputs) == 1
        assert (attrs["plugin_version"].value, attrs["plugin_namespace"].value) == ("1", "enginesmith")
    assert trt_lint.lint(dst, "11") == []


def test_trt_lowering_refuses_plugin_weights_beyond_the_protobuf_limit(tmp_path, monkeypatch):
    """The plugin's weights are node attributes inside the ONNX protobuf (2 GiB at most): past the
    limit the lowering says so, before saving, instead of the protobuf writer crashing. The limit is
    lowered here to three 128x128 float16 weights; the test model has 14 such layers or larger.
    The IR op (lower=none) keeps W an initializer, saved in external data like every other weight."""
    import enginesmith.passes.quant.sparsify as module
    from enginesmith.passes.manager.pipeline import run_pipeline
    from helpers.paged_graphs import h64_fp16_graph

    monkeypatch.setattr(module, "INLINE_LIMIT", 3 * 128 * 128 * 2)
    spec = "sparsify:method=magnitude,only_profitable=false,lower="
    out = tmp_path / "trt"
    with pytest.raises(UserError, match=r"takes its weights as node attributes.* with these 14 layers") as err:
        run_pipeline(h64_fp16_graph(), out / "model.onnx", spec + "trt", progress=False)
    assert "lower=ort" in err.value.fix
    assert list(out.iterdir()) == []                         # nothing half-written
    run_pipeline(h64_fp16_graph(), tmp_path / "ir" / "model.onnx", spec + "none", progress=False)
    model = ir.load(tmp_path / "ir" / "model.onnx")
    weights = [n.inputs[1].const_value for n in model.graph if n.op_type == "SparseGemm24"]
    assert len(weights) == 14 and all(isinstance(w, ir.ExternalTensor) for w in weights)


def test_trt_lowering_refuses_bad_weights_and_types():
    def graph(w: np.ndarray, dtype) -> ir.Model:
        x = ir.Value(name="x", type=ir.TensorType(dtype), shape=ir.Shape(["m", w.shape[1]]))
        wv = ir.Value(name="w", type=ir.TensorType(dtype), shape=ir.Shape(w.shape))
        wv.const_value = ir.Tensor(w.astype(ir.DataType(dtype).numpy()), name="w")
        node = ir.Node("enginesmith", "SparseGemm24", [x, wv], num_outputs=1, name="sg")
        node.outputs[0].name, node.outputs[0].type = "y", ir.TensorType(dtype)
        node.outputs[0].shape = ir.Shape(["m", w.shape[0]])
        g = ir.Graph([x], [node.outputs[0]], nodes=[node], initializers=[wv],
                     opset_imports={"": 23, "enginesmith": 1})
        return ir.Model(g, ir_version=10)

    rng = np.random.default_rng(3)
    dense = rng.standard_normal((32, 64))
    with pytest.raises(UserError, match=r"SparseGemm24 'sg' weight is not 2:4 sparse: row 0, columns 0\.\.3"):
        lower_sparse_graph(graph(dense, ir.DataType.FLOAT16), "trt")
    with pytest.raises(UserError, match="float16/bfloat16"):
        lower_sparse_graph(graph(prune_24(dense, np.abs(dense)), ir.DataType.FLOAT), "trt")
    with pytest.raises(UserError, match="multiples of 16"):
        lower_sparse_graph(graph(prune_24(dense[:, :20], np.abs(dense[:, :20])), ir.DataType.FLOAT16), "trt")
    with pytest.raises(UserError, match="method='random'"):
        SparsifyParams(method="random")
    with pytest.raises(UserError, match="lower='cuda'"):
        SparsifyParams(lower="cuda")


def test_wanda_without_calibration_is_refused(tiny_engine):
    model = ir.load(tiny_engine("llama") / "model.onnx")
    with pytest.raises(UserError, match="needs calibration data"):
        sparsify(model, SparsifyParams(only_profitable=False), None)
