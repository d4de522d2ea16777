"""GPTQ: the blocked numpy walk against a plain torch transcription of the paper's algorithm, its
layer-output error against RTN's, the Hessian collector, and the pass's nodes (sym and asym) as ORT
runs them after lowering."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest
import torch

from enginesmith.passes import run_pipeline
from enginesmith.passes.analysis import hessian
from enginesmith.passes.analysis.calibrate import open_session, run_windows
from enginesmith.passes.lower.lower_ort import pack_uint4
from enginesmith.passes.quant import qmath
from enginesmith.passes.quant.gptq import dequantize, gptq_quantize


def torch_gptq(w_kn, h, block_size, act_order, symmetric, damp=0.01):
    """Frantar et al.'s GPTQ, one column at a time with no lazy batching, on W^T [N, K] (the paper's
    layout), static groups under act-order; returns the dequantized W [K, N]."""
    W = torch.tensor(w_kn.T, dtype=torch.float64).clone()
    H = torch.tensor(h, dtype=torch.float64).clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    def params(x):                                   # x [N, g] -> scale, zero [N]
        if symmetric:
            return x.abs().amax(1).clamp_min(1e-12) / 7, torch.zeros(x.shape[0], dtype=x.dtype)
        lo, hi = x.amin(1).clamp_max(0), x.amax(1).clamp_min(0)
        s = (hi - lo).clamp_min(1e-12) / 15
        return s, torch.round(-lo / s)

    def quant(x, s, z):
        lo, hi = (-8, 7) if symmetric else (0, 15)
        return (torch.clamp(torch.round(x / s) + z, lo, hi) - z) * s

    groups = [params(W[:, g:g + block_size]) for g in range(0, cols, block_size)] if act_order else None
    perm = torch.argsort(torch.diag(H), descending=True, stable=True) if act_order else torch.arange(cols)
    W, H = W[:, perm], H[perm][:, perm]
    H += damp * torch.mean(torch.diag(H)) * torch.eye(cols, dtype=H.dtype)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    for i in range(cols):
        col = int(perm[i])
        if act_order:
            s, z = groups[col // block_size]
        elif i % block_size == 0:
            s, z = params(W[:, i:i + block_size])
        Q[:, i] = quant(W[:, i], s, z)
        err = (W[:, i] - Q[:, i]) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
    return Q[:, torch.argsort(perm)].T.numpy()


def _problem(seed=0, k=96, n=24, rows=256):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, k)) * np.exp(rng.normal(size=k))    # uneven channel scales
    x[:, 7] = 0.0                                                  # one dead channel
    w = rng.normal(size=(k, n))
    return x, w, x.T @ x / rows


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_matches_the_torch_reference(act_order, symmetric):
    x, w, h = _problem()
    codes, scale, zero = gptq_quantize(w, h, 32, act_order, symmetric, lazy=16)   # lazy != block
    ours = dequantize(codes, scale, zero, 32)
    ref = torch_gptq(w, h, 32, act_order, symmetric)
    assert np.abs(ours - ref).max() < 1e-5
    lo, hi = (-8, 7) if symmetric else (0, 15)
    assert codes.min() >= lo and codes.max() <= hi and (symmetric == (not zero.any()))


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_layer_error_below_rtn(symmetric):
    x, w, h = _problem(seed=1, k=256, n=64, rows=1024)
    x_test = x[:512]
    codes, scale, zero = gptq_quantize(w, x_test.T @ x_test / 512, 64, True, symmetric)

    def err(v):
        return np.square(x_test @ v - x_test @ w).sum()
    assert err(dequantize(codes, scale, zero, 64)) < 0.7 * err(qmath.fake_int4_blocks(w, 64))


@pytest.mark.parametrize("symmetric", [True, False])
def test_clip_search_never_raises_the_weighted_block_error(symmetric):
    from enginesmith.passes.quant.gptq import block_params, quantize_row

    rng = np.random.default_rng(4)
    w = rng.standard_t(3, size=(32, 40))                           # heavy tails: clipping pays
    h_diag = np.exp(rng.normal(size=32))

    def err(scale, zero):
        return h_diag @ np.square(w - (quantize_row(w, scale, zero, symmetric) - zero) * scale)
    full, clipped = err(*block_params(w, symmetric)), err(*block_params(w, symmetric, h_diag, 20))
    assert np.all(clipped <= full + 1e-12) and clipped.sum() < 0.9 * full.sum()


def test_hessians_are_the_gram_of_every_calibration_token(tiny_onnx, calib):
    src = tiny_onnx("llama")
    model = ir.load(src)
    name = next(n.inputs[0].name for n in model.graph if n.op_type == "MatMul"
                and n.inputs[1].const_value is not None)
    k = int(next(n.inputs[1].const_value.shape[0] for n in model.graph if n.op_type == "MatMul"
                 and n.inputs[0].name == name))
    ((got_name, h),) = list(hessian.collect(src, [name], {name: k}, calib, budget_bytes=1, progress=False))
    xs = [o[0].reshape(-1, k) for o in run_windows(open_session(src, [name]), [name], calib, False)]
    x = np.concatenate(xs).astype(np.float64)
    assert got_name == name and np.allclose(h, x.T @ x / len(x), rtol=1e-4, atol=1e-6)
    assert hessian.chunks(["a", "b", "c"], {"a": 10, "b": 10, "c": 20}, 10 * 10 * 8 * 2) == [["a", "b"], ["c"]]


def test_pack_uint4_zero_points():
    rng = np.random.default_rng(0)
    q = rng.integers(0, 16, size=(200, 6)).astype(np.uint8)
    z = rng.integers(0, 16, size=(4, 6)).astype(np.uint8)
    b, zp = pack_uint4(q, z, 64)
    assert b.shape == (6, 4, 32) and zp.shape == (6, 2)
    codes = np.stack([b & 0xF, b >> 4], axis=-1).reshape(6, 256).T
    assert np.array_equal(codes[:200], q) and np.array_equal(codes[200:], np.repeat(z[3:], 56, axis=0))
    assert np.array_equal(np.stack([zp & 0xF, zp >> 4], axis=-1).reshape(6, 4).T, z)


@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_pass_writes_blocked_dq_that_ort_runs(tiny_onnx, calib, tmp_path, symmetric):
    from quant_helpers import ort_logits

    src = tiny_onnx("llama")
    qdq, low = tmp_path / "qdq.onnx", tmp_path / "low.onnx"
    (entry,) = run_pipeline(src, qdq, f"gptq:block_size=32:symmetric={symmetric}", calibration=calib,
                            progress=False)
    assert entry["counts"]["linears"] == 14 and not entry["exact"]
    assert entry["counts"]["better_than_rtn"] >= 12                 # calibration error, per linear
    dqs = [n for n in ir.load(qdq).graph if n.op_type == "DequantizeLinear"]
    kind = ir.DataType.INT4 if symmetric else ir.DataType.UINT4
    assert len(dqs) == 14 and all(d.inputs[0].const_value.dtype == kind for d in dqs)
    assert all((len(d.inputs) > 2 and d.inputs[2] is not None) != symmetric for d in dqs)
    (lowered,) = run_pipeline(qdq, low, "lower_ort:accuracy_level=0", progress=False)
    assert lowered["counts"]["matmulnbits"] == 14 and lowered["max_diff"] <= lowered["tolerance"]
    ids = np.random.default_rng(3).integers(0, 49152, size=(1, 9))
    assert np.isfinite(ort_logits(low, ids)).all()
