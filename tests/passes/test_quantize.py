"""W8A8 Q/DQ, W4A16 blocked DQ, the int8 embedding and the MatMulNBits lowering: structure and numbers."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
from quant_helpers import graph_logits, ort_logits

from enginesmith.passes import run_pipeline
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer, set_constant
from enginesmith.passes.analysis.linears import find_linears, select
from enginesmith.passes.lower.lower_ort import pack_int4
from enginesmith.passes.manager.pipeline import save
from enginesmith.passes.manager.verify import compare


def _ops(path) -> list[str]:
    return [n.op_type for n in ir.load(path).graph]


def _close(a: np.ndarray, b: np.ndarray) -> float:
    """Relative RMS difference of two logit arrays."""
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(a ** 2)))


IDS = np.random.default_rng(3).integers(0, 49152, size=(2, 7))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_w8a8_qdq_layout(tiny_onnx, calib, tmp_path, family):
    src, dst = tiny_onnx(family), tmp_path / "w8a8.onnx"
    (sq, entry) = run_pipeline(src, dst, "smoothquant,quantize_w8a8", calibration=calib, progress=False)
    linears = {"llama": 14, "gpt2": 8}[family]
    assert entry["counts"]["linears"] == linears
    model = ir.load(dst)
    for node in model.graph:
        if node.op_type in ("MatMul", "Gemm") and node.inputs[1].producer() is not None \
                and node.inputs[1].producer().op_type == "DequantizeLinear":
            x_dq, w_dq = node.inputs[0].producer(), node.inputs[1].producer()
            assert x_dq.op_type == "DequantizeLinear"
            assert x_dq.inputs[0].producer().op_type == "QuantizeLinear"
            assert x_dq.inputs[1].const_value.shape == ()                      # per-tensor activation scale
            assert w_dq.inputs[0].const_value.dtype == ir.DataType.INT8
            assert w_dq.attributes["axis"].value == 1                          # per output channel of [K, N]
            assert not w_dq.inputs[2].const_value.numpy().any()                # zero points 0
    assert _ops(dst).count("QuantizeLinear") == linears          # a dedicated Q/DQ pair per linear
    assert _ops(dst).count("DequantizeLinear") == 2 * linears
    assert entry["counts"]["activations"] == {"llama": 8, "gpt2": 8}[family]
    a, b = ort_logits(src, IDS), graph_logits(dst, IDS)
    assert _close(a, b) < 0.12            # random weights, 128 calibration tokens: a loose bound
    assert np.isfinite(ort_logits(dst, IDS)).all()                # ORT's fused int8 kernels run it


def test_w4a16_blocked_dq_and_lowering(tiny_onnx, calib, tmp_path):
    src = tiny_onnx("llama")
    qdq, low = tmp_path / "qdq.onnx", tmp_path / "low.onnx"
    run_pipeline(src, qdq, "quantize_w4a16:block_size=32", progress=False)
    model = ir.load(qdq)
    dqs = [n for n in model.graph if n.op_type == "DequantizeLinear"]
    assert len(dqs) == 14
    for dq in dqs:
        assert dq.inputs[0].const_value.dtype == ir.DataType.INT4
        assert dq.attributes["block_size"].value == 32 and dq.attributes["axis"].value == 0
        k, n = dq.inputs[0].const_value.shape
        assert tuple(dq.inputs[1].const_value.shape) == (k // 32, n)
    (entry,) = run_pipeline(qdq, low, "lower_ort:accuracy_level=0", progress=False)
    assert entry["counts"]["matmulnbits"] == 14 and entry["max_diff"] <= entry["tolerance"]
    nbits = [n for n in ir.load(low).graph if n.op_type == "MatMulNBits"]
    assert all(n.domain == "com.microsoft" and n.attributes["accuracy_level"].value == 0 for n in nbits)
    assert "DequantizeLinear" not in _ops(low)
    # the Q/DQ graph means exactly "the weights rounded by qmath": compare with fake-quantized fp32
    model = ir.load(src)
    namer = Namer(model.graph)
    for lin in select(find_linears(model)[0], include_lm_head=False)[0]:
        fake = qmath.fake_int4_blocks(lin.weight_kn(), 32)
        set_constant(model.graph, namer, lin.reader, lin.weight, fake if lin.k_axis == 0 else fake.T)
    save(model, tmp_path / "fake" / "model.onnx")
    assert compare(tmp_path / "fake" / "model.onnx", low).ok
    assert _close(ort_logits(src, IDS), ort_logits(low, IDS)) < 0.5   # random weights: int4 is coarse


def test_int8_embedding_shared_with_tied_lm_head(tiny_onnx, tmp_path):
    src, dst, low = tiny_onnx("llama"), tmp_path / "emb.onnx", tmp_path / "low.onnx"
    (entry,) = run_pipeline(src, dst, "quantize_embedding", progress=False)
    assert entry["counts"] == {"tables": 1, "shared_readers": 1}

    def big_tables(path):
        return [v.const_value.dtype for v in ir.load(path).graph.initializers.values()
                if v.const_value.size >= 49152 * 64]
    assert big_tables(dst) == [ir.DataType.INT8]              # one int8 copy serves both readers
    data = dst.with_name("emb.onnx.data").stat().st_size
    assert data < 0.5 * src.with_name("model.onnx.data").stat().st_size
    assert _close(ort_logits(src, IDS), ort_logits(dst, IDS)) < 0.02
    # ORT lowering: the lm_head becomes an 8-bit MatMulNBits over the same (uint8) table
    (lowered,) = run_pipeline(dst, low, "lower_ort", progress=False)
    assert lowered["counts"]["matmulnbits_8bit"] == 1 and lowered["counts"]["gathers_shared"] == 1
    assert lowered["max_diff"] <= lowered["tolerance"]
    assert big_tables(low) == [ir.DataType.UINT8]
    assert "DequantizeLinear" not in _ops(low)


def test_quant_math():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(200, 24)).astype(np.float32)          # K not a multiple of the block
    q, s = qmath.int4_blocks(w, 64)
    assert q.shape == w.shape and s.shape == (4, 24) and q.min() >= -8 and q.max() <= 7
    err = np.abs(qmath.fake_int4_blocks(w, 64) - w)
    assert np.all(err <= np.repeat(s, 64, axis=0)[:200] / 2 + 1e-6)   # round to nearest
    q8, s8 = qmath.int8_per_channel(w)
    assert np.abs(q8.astype(np.float32) * s8 - w).max() <= s8.max() / 2 + 1e-6
    packed = pack_int4(q, 64)                                  # [N, blocks, 32]: low nibble first
    assert packed.shape == (24, 4, 32)
    lo, hi = (packed & 0xF).astype(np.int16) - 8, (packed >> 4).astype(np.int16) - 8
    unpacked = np.stack([lo, hi], axis=-1).reshape(24, 256).T[:200]
    assert np.array_equal(unpacked, q)


def test_awq_clip_never_hurts_the_calibration_error(tiny_onnx, calib, tmp_path):
    from enginesmith.passes.quant.awq_clip import clip_weight

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 96)).astype(np.float32)
    w = rng.normal(size=(96, 8)).astype(np.float32)
    w[5, 3] = 12.0                                              # one outlier weight
    clipped = clip_weight(x, w, 32, 20, 0.5)
    assert np.abs(clipped[:32, 3]).max() < 12.0                # its block got a tighter range

    def err(v):
        return np.square(x @ qmath.fake_int4_blocks(v, 32) - x @ w).sum()
    assert err(clipped) <= err(w)
    report = run_pipeline(tiny_onnx("llama"), tmp_path / "clip.onnx",
                          "awq:block_size=32,awq_clip:block_size=32,quantize_w4a16:block_size=32",
                          calibration=calib, progress=False)
    assert [r["name"] for r in report] == ["awq", "awq_clip", "quantize_w4a16"]
    assert report[1]["counts"]["linears"] == 14 and not report[1]["exact"]
