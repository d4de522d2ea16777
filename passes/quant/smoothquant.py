"""SmoothQuant (Xiao et al. 2023), folded into the graph: an exact pass run before W8A8.

Per site (see sites.py) and input channel j:

    s_j = max|X_j|^α / max|W_j|^(1-α)          X -> X / s (norm γ, β; or v/up columns)
                                               W -> diag(s) W (the consumers' rows)

migrating activation outliers into the weights, where per-channel quantization absorbs them.
α is one number for the model, or searched per site on the calibration rows (`search=true`): the
α of a grid that minimizes the site's output error under W8A8 fake quantization.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer
from enginesmith.passes.quant.fold import fold_scales, weight_row_absmax
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.analysis.sites import Site, plan

SEARCH_GRID = tuple(round(0.05 * i, 2) for i in range(2, 19))  # 0.10 .. 0.90
_FLOOR = 1e-5


@dataclass(frozen=True)
class SmoothQuantParams:
    alpha: float = 0.5            # migration strength in [0, 1]; 0 = no smoothing
    search: bool = False          # pick α per site from SEARCH_GRID instead
    through_v: bool = True        # smooth o_proj through v_proj (the V cache then holds V / s)
    through_up: bool = True       # smooth down_proj through up_proj (SwiGLU)
    include_lm_head: bool = False

    def __post_init__(self):
        if not 0.0 <= self.alpha <= 1.0:
            raise UserError(f"smoothquant alpha={self.alpha} is outside [0, 1]",
                            "use an alpha between 0 and 1 (0.5 is the paper's default)")


def smooth_scales(act_max: np.ndarray, w_max: np.ndarray, alpha: float) -> np.ndarray:
    """s = act_max^α / w_max^(1-α); channels never seen active (or with zero weights) keep s = 1."""
    act = np.maximum(act_max.astype(np.float64), _FLOOR)
    w = np.maximum(w_max.astype(np.float64), _FLOOR)
    s = act ** alpha / w ** (1.0 - alpha)
    dead = (act_max <= _FLOOR) | (w_max <= _FLOOR)
    return np.where(dead, 1.0, np.clip(s, _FLOOR, 1.0 / _FLOOR))


def w8a8_error(x: np.ndarray, weights: list[np.ndarray], act_max_k: np.ndarray, s_k: np.ndarray) -> float:
    """Relative output error of the site's linears under W8A8 after smoothing by s (per K)."""
    xs = x / s_k
    xq = qmath.fake_int8_act(xs, qmath.act_scale((act_max_k / s_k).max()))
    err = ref = 0.0
    for w in weights:
        y_ref = x @ w
        y = xq @ qmath.fake_int8_per_channel(w * s_k[:, None])
        err += float(np.square(y - y_ref).sum())
        ref += float(np.square(y_ref).sum())
    return err / max(ref, 1e-12)


def _site_alpha(site: Site, stats, act_max: np.ndarray, w_max: np.ndarray, act_max_k) -> tuple[float, float]:
    x = stats[site.consumers[0].x.name].rows
    weights = [lin.weight_kn() for lin in site.consumers]
    best = (np.inf, 0.0)
    for alpha in SEARCH_GRID:
        s_k = site.consumer_scale(smooth_scales(act_max, w_max, alpha))
        best = min(best, (w8a8_error(x, weights, act_max_k, s_k), alpha))
    return best[1], best[0]


@register("smoothquant", SmoothQuantParams, exact=True, calibrated=True)
def smoothquant(model: ir.Model, params: SmoothQuantParams, ctx: PassContext) -> PassResult:
    """Fold SmoothQuant scales into norms / v / up projections and the following linears."""
    sites, skipped = plan(model, params.include_lm_head, params.through_v, params.through_up)
    counts = {"sites": len(sites), "norm": 0, "attn_v": 0, "mlp_up": 0,
              "linears_smoothed": sum(len(s.consumers) for s in sites),
              "linears_not_smoothed": len([r for r in skipped if r.rule == "site"])}
    if not sites:
        return PassResult(counts, skipped)
    stats = ctx.stats(sorted({name for s in sites for name in s.act_names}))
    namer, details = Namer(model.graph), []
    for site in sites:
        act_max_k = np.max([stats[n].amax for n in site.act_names], axis=0)
        act_max = site.pool(act_max_k)
        w_max = site.pool(weight_row_absmax(site))
        alpha, err = (_site_alpha(site, stats, act_max, w_max, act_max_k) if params.search
                      else (params.alpha, None))
        s = smooth_scales(act_max, w_max, alpha)
        fold_scales(model.graph, namer, site, s)
        counts[site.kind] += 1
        s_k = site.consumer_scale(s)
        details.append({"site": site.name, "kind": site.kind, "alpha": alpha,
                        "act_max": round(float(act_max.max()), 4),
                        "act_max_smoothed": round(float((act_max_k / s_k).max()), 4),
                        "s_min": round(float(s.min()), 6), "s_max": round(float(s.max()), 4),
                        **({"w8a8_error": err} if err is not None else {})})
    return PassResult(counts, skipped, details)
