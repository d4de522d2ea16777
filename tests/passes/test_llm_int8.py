"""llm_int8: outlier input channels in float, the rest W8A8, against a numpy reference of the same
arithmetic; and on a tiny model, the nodes it writes and that ORT runs them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from enginesmith.passes import run_pipeline
from enginesmith.passes.analysis.calibrate import ActStats
from enginesmith.passes.manager.pipeline import save
from enginesmith.passes.machinery.registry import PassContext
from enginesmith.passes.quant import qmath
from enginesmith.passes.quant.llm_int8 import LlmInt8Params, llm_int8, outlier_channels


def _one_linear(tmp: Path, w: np.ndarray) -> Path:
    """x [R, K] -> MatMul(W) -> Identity -> y (the Identity keeps it from looking like an lm_head)."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="linear"), helper.make_node("Identity", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["r", w.shape[0]])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r", w.shape[1]])],
                              [numpy_helper.from_array(w, "w")])
    path = tmp / "one.onnx"
    save(ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])), path)
    return path


def _run(path: Path, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.add_session_config_entry("session.disable_quant_qdq", "1")   # the graph's arithmetic, not ORT's kernels
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]


def test_outlier_channels_by_magnitude():
    amax = np.array([1.0, 9.0, 2.0, 30.0, 7.0, 0.5, 1.0, 1.0, 1.0, 1.0] * 4)
    assert outlier_channels(amax, 6.0, 0.5).tolist() == [1, 3, 4, 11, 13, 14, 21, 23, 24, 31, 33, 34]
    assert outlier_channels(amax, 6.0, 0.1).tolist() == [3, 13, 23, 33]          # capped: the largest first


def test_llm_int8_matches_numpy_reference(tmp_path):
    rng = np.random.default_rng(0)
    k, n = 64, 24
    x = rng.normal(size=(200, k)).astype(np.float32)
    x[:, [5, 40]] *= 40.0                                               # two outlier channels
    w = rng.normal(size=(k, n)).astype(np.float32)
    src = _one_linear(tmp_path, w)
    model = ir.load(src)
    stats = ActStats(np.abs(x).max(0), np.abs(x).mean(0), x[:64])
    ctx = PassContext(src, calibration=object(), _stats={"x": stats})
    result = llm_int8(model, LlmInt8Params(threshold=6.0, max_fraction=0.1), ctx)
    assert result.counts == {"linears": 1, "mixed_linears": 1, "outlier_channels": 2, "activations": 1}
    out = tmp_path / "mixed" / "model.onnx"
    save(model, out)
    got = _run(out, x)

    keep = np.ones(k, np.float32)
    keep[[5, 40]] = 0
    s = qmath.act_scale(float(np.abs(x * keep).max()))
    inlier_w = w * keep[:, None]
    ref = qmath.fake_int8_act(x * keep, s) @ qmath.fake_int8_per_channel(inlier_w) + x[:, [5, 40]] @ w[[5, 40]]
    np.testing.assert_allclose(got, ref, atol=1e-3, rtol=1e-4)

    plain = qmath.fake_int8_act(x, qmath.act_scale(float(np.abs(x).max()))) @ qmath.fake_int8_per_channel(w)
    exact = x @ w
    assert qmath.relative_error(got, exact) < 0.1 * qmath.relative_error(plain, exact)


def test_llm_int8_on_a_tiny_model(tiny_onnx, calib, tmp_path):
    from quant_helpers import graph_logits, ort_logits

    src, dst = tiny_onnx("llama"), tmp_path / "int8.onnx"
    (entry,) = run_pipeline(src, dst, "llm_int8:threshold=3", calibration=calib, progress=False)
    assert entry["counts"]["linears"] == 14 and entry["counts"]["mixed_linears"] >= 1
    ops = [n.op_type for n in ir.load(dst).graph]
    before = [n.op_type for n in ir.load(src).graph]
    with_outliers = sum(bool(d["outliers"]) for d in entry["details"])
    assert ops.count("QuantizeLinear") == 14 and ops.count("Gather") - before.count("Gather") == with_outliers
    assert ops.count("Add") - before.count("Add") == entry["counts"]["mixed_linears"]
    ids = np.random.default_rng(3).integers(0, 49152, size=(1, 7))
    a, b = ort_logits(src, ids), graph_logits(dst, ids)
    assert np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a ** 2)) < 0.12
