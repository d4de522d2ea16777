"""GPTQ (Frantar et al. 2023) for W4A16: int4 blocks chosen column by column with error feedback.

Per linear, with H = X^T X / n over every calibration token (analysis/hessian.py), GPTQ minimizes
|| X W - X Q ||² by quantizing one input channel (a row k of W [K, N]) at a time and spreading its
rounding error over the rows not yet quantized, through the inverse Hessian's Cholesky factor U:

    for k in order:                     (act_order: descending diag(H), the busiest channels first)
        q_k  = Q(w_k)                   (its block's scale [and zero point])
        e    = (w_k - q_k) / U[k, k]
        w_j -= U[k, j] · e    for every later j        (lazily, 128 rows at a time)

Block parameters (scale, zero point per [block_size rows, column]):
  act_order=false  taken from the error-updated weights when the walk enters the block (GPTQ's
                   default); the order is the channel order, so blocks stay contiguous along K.
  act_order=true   taken from the original weights up front ("static groups"), so a channel
                   quantized out of order still belongs to its contiguous K block: the output is
                   the same blocked DequantizeLinear that quantize_w4a16 writes, which every
                   engine path runs (no g_idx).
  clip_grid        each block column's range shrunk to the factor (1, 0.95, ...) that minimizes
                   Σ_k H_kk (w_k - Q(w_k))², GPTQ's "mse" option weighted by the Hessian diagonal
  symmetric        int4 in [-8, 7], scale = max|w| / 7 (quantize_w4a16's grid; TensorRT's form)
  asymmetric       uint4 in [0, 15] with a zero point: scale = (max - min) / 15 over a range that
                   includes 0 (ORT's MatMulNBits takes it; TensorRT wants zero points 0)

Hessians come from the fp32 graph (not layer by layer through already quantized layers).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.analysis import hessian
from enginesmith.passes.machinery.edit import Namer
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.quant import qmath
from enginesmith.passes.quant.w4a16 import MIN_OPSET, check_block_size, replace_with_int4
from enginesmith.passes.quant.w8a8 import chosen_or_fail

UINT4_MAX = 15.0


@dataclass(frozen=True)
class GptqParams:
    block_size: int = 128
    act_order: bool = True
    symmetric: bool = True
    damp: float = 0.01            # H += damp · mean(diag H) · I
    clip_grid: int = 20           # block ranges searched: max · (1 - i / clip_grid), i < clip_grid / 2 (0: off)
    include_lm_head: bool = False

    def __post_init__(self):
        check_block_size(self.block_size, "gptq")
        if not 0.0 < self.damp <= 1.0:
            raise UserError(f"gptq damp={self.damp} is outside (0, 1]", "use damp=0.01 (the paper's value)")
        if not 0 <= self.clip_grid <= 100:
            raise UserError(f"gptq clip_grid={self.clip_grid} is outside [0, 100]", "use 20, or 0 for no search")


def _range_params(lo: np.ndarray, hi: np.ndarray, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    if symmetric:
        return np.maximum(np.maximum(-lo, hi), 1e-12) / qmath.INT4_MAX, np.zeros(lo.shape)
    scale = np.maximum(hi - lo, 1e-12) / UINT4_MAX
    return scale, np.rint(-lo / scale)


def block_params(w: np.ndarray, symmetric: bool, h_diag: np.ndarray | None = None,
                 clip_grid: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(scale [N], zero point [N]) of one block w [rows, N] (zero point 0 when symmetric). With a
    clip grid, each column's range is shrunk to the factor 1 - i / clip_grid (i < clip_grid / 2)
    that minimizes Σ_k h_diag[k] (w - Q(w))² (i = 0, the full range, is a candidate)."""
    lo, hi = np.minimum(w.min(axis=0), 0.0), np.maximum(w.max(axis=0), 0.0)
    best = _range_params(lo, hi, symmetric)
    if not clip_grid:
        return best
    weight = np.ones(len(w)) if h_diag is None else h_diag
    best_err = np.full(w.shape[1], np.inf)
    for i in range(max(1, clip_grid // 2)):
        f = 1.0 - i / clip_grid
        scale, zero = _range_params(lo * f, hi * f, symmetric)
        deq = (quantize_row(w, scale, zero, symmetric) - zero) * scale
        err = weight @ np.square(w - deq)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best = (np.where(better, scale, best[0]), np.where(better, zero, best[1]))
    return best


def quantize_row(w: np.ndarray, scale: np.ndarray, zero: np.ndarray, symmetric: bool) -> np.ndarray:
    """Integer codes of one row (int4 in [-8, 7] or uint4 in [0, 15])."""
    lo, hi = (-8.0, qmath.INT4_MAX) if symmetric else (0.0, UINT4_MAX)
    return np.clip(np.rint(w / scale) + zero, lo, hi)


def inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """Upper U with U^T U = (H + damp · mean(diag H) · I)^-1."""
    h = h + damp * float(np.mean(np.diag(h))) * np.eye(len(h))
    lower = np.linalg.cholesky(h)
    inv_lower = np.linalg.solve(lower, np.eye(len(h)))
    return np.linalg.cholesky(inv_lower.T @ inv_lower).T


def gptq_quantize(w_kn: np.ndarray, h: np.ndarray, block_size: int, act_order: bool = True,
                  symmetric: bool = True, damp: float = 0.01, lazy: int = 128, clip_grid: int = 0
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [K, N] int8, scale [nb, N] float32, zero point [nb, N] int8) for W [K, N] and H [K, K];
    the weight means (codes - zero) · scale, blockwise along K."""
    w = w_kn.astype(np.float64).copy()
    h = h.astype(np.float64).copy()
    k, n = w.shape
    nb = qmath.blocks(k, block_size)
    dead = np.diag(h) == 0                     # channels that never fire: their weights don't matter
    h[dead, dead] = 1.0
    w[dead] = 0.0
    scale, zero = np.ones((nb, n)), np.zeros((nb, n))
    if act_order:
        for b in range(nb):
            rows = slice(b * block_size, (b + 1) * block_size)
            scale[b], zero[b] = block_params(w[rows], symmetric, np.diag(h)[rows], clip_grid)
        order = np.argsort(-np.diag(h), kind="stable")
    else:
        order = np.arange(k)
    w, h = w[order], h[np.ix_(order, order)]
    u = inverse_cholesky(h, damp)
    codes = np.zeros((k, n))
    step = block_size if not act_order else lazy   # lazy batches align with blocks without act_order
    for i1 in range(0, k, step):
        i2 = min(i1 + step, k)
        w1, err = w[i1:i2].copy(), np.zeros((i2 - i1, n))
        for i in range(i2 - i1):
            row = order[i1 + i]
            b = row // block_size
            if not act_order and i == 0:       # entering block b: its parameters from the updated weights
                scale[b], zero[b] = block_params(w1, symmetric, np.diag(h)[i1:i2], clip_grid)
            c = quantize_row(w1[i], scale[b], zero[b], symmetric)
            codes[row] = c
            err[i] = (w1[i] - (c - zero[b]) * scale[b]) / u[i1 + i, i1 + i]
            w1[i:] -= np.outer(u[i1 + i, i1 + i:i2], err[i])
        w[i2:] -= u[i1:i2, i2:].T @ err
    return codes.astype(np.int8), scale.astype(np.float32), zero.astype(np.int8)


def dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, block_size: int) -> np.ndarray:
    """W [K, N] float32 that the codes mean."""
    k = codes.shape[0]
    rep = lambda a: np.repeat(a.astype(np.float32), block_size, axis=0)[:k]  # noqa: E731
    return (codes.astype(np.float32) - rep(zero)) * rep(scale)


def hessian_error(w: np.ndarray, w_hat: np.ndarray, h: np.ndarray) -> float:
    """|| X (W_hat - W) ||² / || X W ||², from H = X^T X / n."""
    d = (w_hat - w).astype(np.float64)
    ref = float(np.sum((h @ w) * w))
    return float(np.sum((h @ d) * d)) / max(ref, 1e-30)


@register("gptq", GptqParams, exact=False, calibrated=True)
def gptq(model: ir.Model, params: GptqParams, ctx: PassContext) -> PassResult:
    """Int4 blocks chosen by GPTQ from calibration Hessians; writes quantize_w4a16's nodes."""
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OPSET:
        raise UserError(f"gptq needs opset >= {MIN_OPSET} (blocked DequantizeLinear); the graph has {opset}",
                        f"export with --opset {MIN_OPSET} or newer")
    if ctx.calibration is None:
        raise UserError("gptq needs calibration data (its Hessians)", "pass a calibration set")
    chosen, skipped = chosen_or_fail(model, params.include_lm_head, "gptq")
    by_input: dict[str, list] = {}
    for lin in chosen:
        by_input.setdefault(lin.x.name, []).append(lin)
    widths = {name: lins[0].k for name, lins in by_input.items()}
    graph, namer, bs = model.graph, Namer(model.graph), params.block_size
    details = []
    for name, h in hessian.collect(ctx.model_path, list(by_input), widths, ctx.calibration,
                                   progress=ctx.progress):
        for lin in by_input[name]:
            w = lin.weight_kn()
            codes, scale, zero = gptq_quantize(w, h, bs, params.act_order, params.symmetric, params.damp,
                                               clip_grid=params.clip_grid)
            rtn = qmath.fake_int4_blocks(w, bs)
            details.append({"linear": lin.name, "error": hessian_error(w, dequantize(codes, scale, zero, bs), h),
                            "rtn_error": hessian_error(w, rtn, h)})
            replace_with_int4(graph, namer, lin, codes, scale, None if params.symmetric else zero, bs)
    better = sum(d["error"] < d["rtn_error"] for d in details)
    counts = {"linears": len(chosen), "int4_params": sum(lin.k * lin.n for lin in chosen),
              "better_than_rtn": better}
    return PassResult(counts, skipped, details)
