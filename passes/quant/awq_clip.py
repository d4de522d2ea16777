"""AWQ's weight clipping (Lin et al. 2024, "auto_clip"): a lossy pass run between awq and quantize_w4a16.

For every int4 block (block_size rows of K) and output column of a linear, the clip range m is
searched over max|W| · (1 - i / grid), i < grid · max_shrink, minimizing the block's contribution
to the layer output error on the calibration rows:

    err(m) = || X_b Q_m(W_b) - X_b W_b ||²       Q_m: clip to [-m, m], round to m / 7 steps

The weights are clipped to the best m in place (fp32); quantize_w4a16 then rounds them, and since
the block's max is now m its step is exactly the one searched. i = 0 (no clip) is in the grid, so
no block gets worse on calibration data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer, set_constant
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.quant.w4a16 import check_block_size
from enginesmith.passes.quant.w8a8 import chosen_or_fail


@dataclass(frozen=True)
class AwqClipParams:
    block_size: int = 128         # must match the quantize_w4a16 that follows
    grid: int = 20
    max_shrink: float = 0.5       # search m down to (1 - max_shrink) · max|W|
    rows: int = 256               # calibration rows used (of the cached ones)
    include_lm_head: bool = False

    def __post_init__(self):
        check_block_size(self.block_size, "awq_clip")
        if not 0.0 < self.max_shrink < 1.0 or not 1 <= self.grid <= 100:
            raise UserError(f"awq_clip: max_shrink={self.max_shrink} / grid={self.grid} out of range",
                            "use 0 < max_shrink < 1 (0.5) and a grid of 10-20")


def clip_weight(x: np.ndarray, w: np.ndarray, block_size: int, grid: int, max_shrink: float) -> np.ndarray:
    """W [K, N] clipped per (block, column) to the range that minimizes the int4 output error."""
    out = w.copy()
    for start in range(0, w.shape[0], block_size):
        xb, wb = x[:, start:start + block_size], w[start:start + block_size]
        ref = xb @ wb                                           # [R, N]
        amax = np.maximum(np.abs(wb).max(axis=0), 1e-12)        # [N]
        best_err, best_m = np.full(w.shape[1], np.inf), amax
        for i in range(int(grid * max_shrink)):
            m = amax * (1.0 - i / grid)
            step = m / qmath.INT4_MAX
            q = np.clip(np.rint(np.clip(wb, -m, m) / step), -8, qmath.INT4_MAX) * step
            err = np.square(xb @ q - ref).sum(axis=0)
            better = err < best_err
            best_err, best_m = np.where(better, err, best_err), np.where(better, m, best_m)
        out[start:start + block_size] = np.clip(wb, -best_m, best_m)
    return out


@register("awq_clip", AwqClipParams, exact=False, calibrated=True)
def awq_clip(model: ir.Model, params: AwqClipParams, ctx: PassContext) -> PassResult:
    """Clip each int4 block's weights to the range that minimizes the layer's output error."""
    chosen, skipped = chosen_or_fail(model, params.include_lm_head, "awq_clip")
    stats = ctx.stats(sorted({lin.x.name for lin in chosen}))
    namer, clipped = Namer(model.graph), 0
    for lin in chosen:
        x = stats[lin.x.name].rows[: params.rows].astype(np.float32)
        w = lin.weight_kn()
        new = clip_weight(x, w, params.block_size, params.grid, params.max_shrink)
        clipped += int((new != w).any(axis=0).sum())
        set_constant(model.graph, namer, lin.reader, lin.weight, new if lin.k_axis == 0 else new.T)
    return PassResult({"linears": len(chosen), "columns_clipped": clipped}, skipped)
