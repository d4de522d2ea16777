"""LLM.int8()-style mixed precision W8A8 (Dettmers et al. 2022): outlier input channels in float.

Per activation X [.., K], the channels whose calibrated max |X| exceeds `threshold` (at most
`max_fraction` of K, the largest first) are the outliers O. Every linear reading X becomes

    X ─ Mul(keep [K]: 0 on O) ─ Q/DQ(s_x: max over kept channels) ─ MatMul(DQ(W_int8, rows O = 0)) ─┐
    X ─ Gather(O, axis -1) [.., |O|] ────────────────────────────── MatMul(W[O, :] float) ──────────── Add ─ y

so the int8 part sees no outlier (its per-tensor scale comes from the ordinary channels, and the
weight scales per output column from the ordinary rows), and the few outlier channels are computed
in the graph's float type (fp16 in an fp16 engine). Same Q/DQ form as quantize_w8a8 (a dedicated
pair per linear, symmetric, zero points 0), so TensorRT and ORT read it the same way. An
activation without outliers gets plain W8A8. Compared with SmoothQuant in benchmarks/quant.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.machinery.edit import Namer, add_initializer, add_node, qdq
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.quant import qmath
from enginesmith.passes.quant.w8a8 import chosen_or_fail, weight_dq


@dataclass(frozen=True)
class LlmInt8Params:
    threshold: float = 6.0        # LLM.int8()'s outlier magnitude
    max_fraction: float = 0.05    # at most this share of an activation's channels stay in float
    include_lm_head: bool = False

    def __post_init__(self):
        if not self.threshold > 0 or not 0 < self.max_fraction <= 0.5:
            raise UserError(f"llm_int8 threshold={self.threshold} / max_fraction={self.max_fraction} out of range",
                            "use threshold > 0 (6.0) and 0 < max_fraction <= 0.5 (0.05)")


def outlier_channels(amax: np.ndarray, threshold: float, max_fraction: float) -> np.ndarray:
    """Sorted indices of the channels over `threshold`, the largest first up to max_fraction of K."""
    over = np.flatnonzero(amax > threshold)
    cap = int(max_fraction * len(amax))
    if len(over) > cap:
        over = over[np.argsort(-amax[over], kind="stable")[:cap]]
    return np.sort(over).astype(np.int64)


@register("llm_int8", LlmInt8Params, exact=False, calibrated=True)
def llm_int8(model: ir.Model, params: LlmInt8Params, ctx: PassContext) -> PassResult:
    """W8A8 with the outlier input channels (max |X| > threshold) computed in float."""
    chosen, skipped = chosen_or_fail(model, params.include_lm_head, "llm_int8")
    stats = ctx.stats(sorted({lin.x.name for lin in chosen}))
    graph, namer = model.graph, Namer(model.graph)
    per_x: dict[int, tuple] = {}                 # id(x) -> (outliers, masked x or None, gathered x)
    details, mixed = [], 0
    for lin in chosen:
        x, st = lin.x, stats[lin.x.name]
        y = lin.node.outputs[0]
        if id(x) not in per_x:
            idx = outlier_channels(st.amax, params.threshold, params.max_fraction)
            if y in graph.outputs:
                idx = idx[:0]
            masked = gathered = None
            if len(idx):
                keep = np.ones(lin.k, x.type.dtype.numpy())
                keep[idx] = 0
                k = add_initializer(graph, namer, f"{x.name}_int8_keep", keep)
                masked = add_node(graph, namer, "Mul", [x, k], like=x, before=lin.node, base=f"{x.name}_inliers")
                i = add_initializer(graph, namer, f"{x.name}_outlier_idx", idx)
                gathered = add_node(graph, namer, "Gather", [x, i], {"axis": -1}, dtype=x.type.dtype, shape=None,
                                    before=lin.node, base=f"{x.name}_outliers")
            per_x[id(x)] = (idx, masked, gathered)
            kept_max = float(np.delete(st.amax, idx).max()) if len(idx) < len(st.amax) else st.tensor_max
            details.append({"activation": x.name, "outliers": idx.tolist(), "max_abs": round(st.tensor_max, 4),
                            "int8_max_abs": round(kept_max, 4)})
        idx, masked, gathered = per_x[id(x)]
        kept_max = float(np.delete(st.amax, idx).max()) if len(idx) else st.tensor_max
        scale = add_initializer(graph, namer, f"{x.name}_scale", np.array(qmath.act_scale(kept_max), x.type.dtype.numpy()))
        zp = add_initializer(graph, namer, f"{x.name}_zero", np.array(0, np.int8))
        w = lin.weight_kn()
        if len(idx):
            lin_in = type(lin)(lin.node, masked, lin.k_axis, lin.transposed_by, lin.bias, lin.is_lm_head)
            lin.node.replace_input_with(0, qdq(graph, namer, lin_in.x, scale, zp, before=lin_in.node))
            w_out = add_initializer(graph, namer, f"{lin.weight.name}_outlier_rows",
                                    np.ascontiguousarray(w[idx].astype(lin.weight.const_value.dtype.numpy())))
            inlier = w.copy()
            inlier[idx] = 0.0
            q, s = qmath.int8_per_channel(inlier)
            weight_dq(graph, namer, lin, q, s)
            uses = list(y.uses())
            order = {id(n): i for i, n in enumerate(graph)}
            first = min((u.node for u in uses), key=lambda n: order[id(n)])
            dtype = x.type.dtype
            branch = add_node(graph, namer, "MatMul", [gathered, w_out], dtype=dtype, shape=y.shape, before=first,
                              base=f"{lin.name}_outliers")
            total = add_node(graph, namer, "Add", [y, branch], dtype=dtype, shape=y.shape, before=first,
                             base=f"{lin.name}_mixed")
            for use in uses:
                use.node.replace_input_with(use.idx, total)
            mixed += 1
        else:
            lin.node.replace_input_with(0, qdq(graph, namer, lin.x, scale, zp, before=lin.node))
            q, s = qmath.int8_per_channel(w)
            weight_dq(graph, namer, lin, q, s)
    counts = {"linears": len(chosen), "mixed_linears": mixed,
              "outlier_channels": sum(len(v[0]) for v in per_x.values()), "activations": len(per_x)}
    return PassResult(counts, skipped, details)
