"""AWQ (Lin et al. 2024) scale search, folded into the graph: an exact pass run before quantize_w4a16.

Per site and input channel j, s_j = mean|X_j|^α, normalized so that sqrt(max(s) min(s)) = 1. For
each α in {0, 1/grid, ..., (grid-1)/grid} the site's linears are fake-quantized as int4 blocks
*after* scaling, and the site's output error is measured on the calibration rows:

    err(α) = Σ_linears || X Q(diag(s) W) / s  -  X W ||²        (α = 0 is plain round-to-nearest)

The best s is folded with the SmoothQuant folding code (producer ÷ s, consumer rows × s), so the
graph stays exactly equivalent and quantize_w4a16 then rounds the scaled weights. Because α = 0 is
in the grid, every site's calibration error is at most RTN's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer
from enginesmith.passes.quant.fold import fold_scales
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.analysis.sites import Site, plan
from enginesmith.passes.quant.w4a16 import check_block_size


@dataclass(frozen=True)
class AwqParams:
    block_size: int = 128         # must match the quantize_w4a16 that follows
    grid: int = 20                # α candidates: 0, 1/grid, ..., (grid-1)/grid
    through_v: bool = True
    through_up: bool = True
    include_lm_head: bool = False

    def __post_init__(self):
        check_block_size(self.block_size, "awq")
        if not 1 <= self.grid <= 100:
            raise UserError(f"awq grid={self.grid} is outside [1, 100]", "use a grid of 10 to 20")


def awq_scales(x_mean: np.ndarray, alpha: float) -> np.ndarray:
    s = np.maximum(x_mean.astype(np.float64), 1e-4) ** alpha
    return s / np.sqrt(s.max() * s.min())


def search_site(site: Site, x: np.ndarray, x_mean: np.ndarray, block_size: int,
                grid: int) -> tuple[float, np.ndarray, float, float]:
    """(best α, its scales over the site's channels, its error, RTN's error) on rows `x` [R, K]."""
    w = np.concatenate([lin.weight_kn() for lin in site.consumers], axis=1)   # [K, ΣN]
    ref = x @ w
    ref_norm = max(float(np.square(ref).sum()), 1e-12)
    results = []
    for i in range(grid):
        alpha = i / grid
        s = awq_scales(x_mean, alpha)
        s_k = site.consumer_scale(s)[:, None].astype(np.float32)
        y = x @ (qmath.fake_int4_blocks(w * s_k, block_size) / s_k)
        results.append((float(np.square(y - ref).sum()) / ref_norm, alpha, s))
    err, alpha, s = min(results, key=lambda r: r[0])
    return alpha, s, err, results[0][0]


@register("awq", AwqParams, exact=True, calibrated=True)
def awq(model: ir.Model, params: AwqParams, ctx: PassContext) -> PassResult:
    """Search activation-aware scales per site for int4 blocks and fold them into the graph."""
    sites, skipped = plan(model, params.include_lm_head, params.through_v, params.through_up)
    counts = {"sites": len(sites), "scaled": 0, "kept_rtn": 0,
              "linears_not_scaled": len([r for r in skipped if r.rule == "site"])}
    if not sites:
        return PassResult(counts, skipped)
    stats = ctx.stats(sorted({name for s in sites for name in s.act_names}))
    namer, details = Namer(model.graph), []
    for site in sites:
        st = stats[site.act_names[0]]
        x_mean = site.pool(st.mean.astype(np.float64), np.mean)
        alpha, s, err, rtn = search_site(site, st.rows.astype(np.float32), x_mean,
                                         params.block_size, params.grid)
        if alpha > 0:
            fold_scales(model.graph, namer, site, s)
            counts["scaled"] += 1
        else:
            counts["kept_rtn"] += 1
        details.append({"site": site.name, "kind": site.kind, "alpha": alpha,
                        "error": err, "rtn_error": rtn})
    return PassResult(counts, skipped, details)
