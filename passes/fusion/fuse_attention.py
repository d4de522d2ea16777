"""fuse_attention: unfused attention subgraphs -> the standard ONNX `Attention` op (opset 23/24).

Dimension legend: B batch, H query heads, Hkv key/value heads (G = H / Hkv), S queries, T keys,
D head size.

    q ──[Mul|Div a]──────────────────────────────────┐
    kv ─[repeat G]─ Transpose(0,1,3,2) ─[Mul|Div b]──┴ MatMul ─[Mul|Div c]─[cap]─[Add m]─[Cast]─ Softmax
    vv ─[repeat G]─────────────────────────────────────────────┐             ─[IsNaN→0]─[Cast]─┘
                                                               └────────────── MatMul ─ y
  =>
    y = Attention(q, kv, vv, m', scale=a·b·c[, softcap=s])   kv, vv keep their Hkv heads

[cap] is Gemma 2's soft-capping Mul(Tanh(Div(x, s)), s) = s·tanh(x / s), applied before the mask, as
the Attention op applies its softcap attribute (the ONNX reference and ONNX Runtime's kernels).

The variants are those the exporters write: TorchScript's and opset < 23 dynamo's decomposition of
`scaled_dot_product_attention` (q and k each scaled by sqrt(scale), the key transposed directly or
through a 3-D Reshape, an additive mask from Where(keep, 0, -inf), a NaN guard after Softmax),
and eager attention (`(q @ k^T) * scale + mask`, Softmax with Casts, no guard).

The GQA repeat of K/V (Unsqueeze(2) - Expand - Reshape) is folded away: with 4-D inputs the
Attention op takes K and V with Hkv heads and infers the grouping from the shapes. (The
`q_num_heads`/`kv_num_heads` attributes exist for 3-D inputs only; the ONNX reference rejects them
on 4-D inputs, so they are not written.)

The mask: Where(keep, 0, -inf) followed by the NaN guard becomes the boolean `keep` (the op gives 0
for a fully masked row, as the guard does); any other additive mask is passed as it is. `is_causal`
stays 0: the exported mask already holds causality and padding, and the op's causal alignment
without a `past_key` input is upper-left, wrong for a query block that follows a cache.

Exact: outputs equal the unfused graph to fp32 rounding (the product of the scales is applied once).
A graph whose attention is already fused passes through unchanged (its Attention nodes are counted,
not touched). Graphs below opset 23 are converted to opset 23 first (onnxscript's version converter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern as _p

from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import ensure_opset, remove_dead_nodes
from enginesmith.passes.machinery.match import Match, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

MIN_OPSET = 23
_FLOATS = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)


@dataclass(frozen=True)
class FuseAttentionParams:
    pass


class UnfusedAttention(Rule):
    """Root: the MatMul of the attention weights with V. One rule; variants are OrValues."""

    name = "unfused_attention"

    def pattern(self, op, q, k, v, mask, q_scale, k_scale, qk_scale, cap_in, cap_out, nan_fill):
        # The key transposed: BHTD -> BHDT directly, or through 3-D [B*H, T, D].
        k_t = _p.OrValue([
            op.Transpose(k, perm=[0, 1, 3, 2]),
            op.Reshape(op.Transpose(op.Reshape(k, _p.ANY_VALUE, _allow_other_attributes=True), perm=[0, 2, 1]),
                       _p.ANY_VALUE, _allow_other_attributes=True),
        ])
        q = _p.OrValue([op.Mul(q, q_scale), op.Div(q, q_scale), q], tag_var="q_op",
                       tag_values=["Mul", "Div", None])
        k_t = _p.OrValue([op.Mul(k_t, k_scale), op.Div(k_t, k_scale), k_t], tag_var="k_op",
                         tag_values=["Mul", "Div", None])
        scores = op.MatMul(q, k_t)
        scores = _p.OrValue([op.Mul(scores, qk_scale), op.Div(scores, qk_scale), scores],
                            tag_var="qk_op", tag_values=["Mul", "Div", None])
        # Gemma 2's soft-capping: softcap * tanh(scores / softcap), before the mask
        scores = _p.OrValue([op.Mul(op.Tanh(op.Div(scores, cap_in)), cap_out), scores], tag_var="capped",
                            tag_values=[True, False])
        scores = _p.OrValue([op.Add(scores, mask), scores], tag_var="masked", tag_values=[True, False])
        scores = _p.OrValue([op.Cast(scores, _outputs=["cast_in"]), scores])
        weights = op.Softmax(scores, _outputs=["softmax"])
        weights = _p.OrValue([op.Where(op.IsNaN(weights), nan_fill, weights), weights], tag_var="nan_guard",
                             tag_values=[True, False])
        weights = _p.OrValue([op.Cast(op.Cast(weights)), op.Cast(weights), weights])
        return op.MatMul(weights, v)

    def check(self, m: Match) -> str | None:
        q, k, v = m["q"], m["k"], m["v"]
        softmax = m["softmax"].producer()
        for name, value in (("query", q), ("key", k), ("value", v)):
            rank = value.shape.rank() if value.shape is not None else None
            if rank is not None and rank != 4:
                return f"{name} is rank {rank}, not [B, heads, seq, head_size]"
        if match.attr(softmax, "axis", -1) not in (-1, 3):
            return f"Softmax over axis {match.attr(softmax, 'axis')}, not the key axis"
        if _dtype(q) not in _FLOATS or _dtype(q) != _dtype(v):
            return "query/value are not of one float type"
        if m["nan_guard"] and _scalar(m["nan_fill"]) != 0.0:
            return "the NaN guard after Softmax does not write 0"
        if scale_of(m) is None:
            return "a scale is not a constant scalar"
        if m["capped"] and softcap_of(m) is None:
            return "the soft-capping is not softcap * tanh(scores / softcap) with one positive constant softcap"
        precision = _softmax_precision(m)
        if precision is False:
            return "Casts around Softmax change the output type"
        if m["masked"] and not _mask_ok(m):
            return "the mask is not a float of the query's type (or a Where(bool, 0, -inf) of one)"
        kv, vv = repeat_source(k), repeat_source(v)
        if (kv is None) != (vv is None):
            return "only one of K and V goes through a GQA repeat"
        return match.private_interior(m)


def _dtype(value: ir.Value) -> ir.DataType | None:
    return value.type.dtype if value.type is not None else None


def _scalar(value: ir.Value | None) -> float | None:
    tensor = match.constant(value)
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(-1)[0])


def scale_of(m: Match) -> float | None:
    """The product of the q, k and score scales (Div counts as its reciprocal), or None."""
    scale = 1.0
    for tag, var in (("q_op", "q_scale"), ("k_op", "k_scale"), ("qk_op", "qk_scale")):
        op = m[tag]
        if op is None:
            continue
        s = _scalar(m[var])
        if s is None or s == 0:
            return None
        scale *= s if op == "Mul" else 1.0 / s
    return scale


def softcap_of(m: Match) -> float | None:
    """softcap of a matched Mul(Tanh(Div(scores, c)), c) (c a positive constant scalar), else None."""
    cap_in, cap_out = _scalar(m["cap_in"]), _scalar(m["cap_out"])
    return cap_in if cap_in is not None and cap_in > 0 and cap_in == cap_out else None


def _softmax_precision(m: Match) -> int | None | bool:
    """The softmax_precision attribute (ONNX type enum) the Casts around Softmax ask for, None when
    they change nothing, False when they change the result's type."""
    inside = _dtype(m["softmax"])
    if inside is None or inside == _dtype(m["q"]):
        return None if (inside is None or inside in _FLOATS) else False
    if m["cast_in"] is None or _dtype(m.root.inputs[0]) != _dtype(m["v"]):
        return False
    return int(inside)


def _mask_ok(m: Match) -> bool:
    mask = m["mask"]
    keep = keep_mask(m)
    return keep is not None or _dtype(mask) == _dtype(m["q"])


def keep_mask(m: Match) -> ir.Value | None:
    """The boolean `keep` of a mask Where(keep, 0, -inf) guarded by IsNaN -> 0, else None."""
    if not m["nan_guard"]:
        return None
    where = m["mask"].producer()
    if where is None or where.op_type != "Where" or len(where.inputs) != 3:
        return None
    keep, zero, neg = where.inputs
    if keep is None or _dtype(keep) != ir.DataType.BOOL:
        return None
    z, n = _scalar(zero), _scalar(neg)
    if z != 0.0 or n is None or not (math.isinf(n) and n < 0):
        return None
    return keep


def repeat_source(value: ir.Value) -> ir.Value | None:
    """x when `value` is the GQA repeat Reshape(Expand(Unsqueeze(x, [2]), ...), ...) of a rank-4 x,
    else None. The check is structural; the pass manager's output comparison confirms it."""
    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand":
        return None
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze" or len(unsqueeze.inputs) < 2:
        return None
    axes = match.int_list(unsqueeze.inputs[1])
    x = unsqueeze.inputs[0]
    rank = x.shape.rank() if x.shape is not None else 4
    if axes not in ([2], [-3]) or rank != 4:
        return None
    out_rank = value.shape.rank() if value.shape is not None else 4
    return x if out_rank == 4 else None


def dense_kv_reason(m: Match, gqa: bool) -> str | None:
    """Why an Attention matched over K/V = Concat(past_k/past_v, new) [+ GQA repeat] (captures
    past_k, past_v, present_k, present_v) is not a layer of the exported dense KV cache; None when it
    is: pasts are graph inputs of static [B, Hkv, P, D] shape, presents are graph outputs concatenated
    along the sequence, the expansion is a GQA repeat, and the Attention has no past or used extra
    outputs of its own. The KV-layout passes (kv_ring, kv_paged) rewrite exactly these layers."""
    att = m.root
    for name in ("past_k", "past_v"):
        if not m[name].is_graph_input():
            return f"{name} is not a graph input"
        shape = m[name].shape
        if shape is None or len(shape) != 4 or not all(isinstance(shape[d], int) for d in (1, 3)):
            return f"{name} has no static [B, Hkv, P, D] shape"
    graph_outputs = {id(v) for v in att.graph.outputs}
    for name in ("present_k", "present_v"):
        if id(m[name]) not in graph_outputs:
            return f"{name} is not a graph output"
        if match.attr(m[name].producer(), "axis") not in (-2, 2):
            return "the KV concat is not along the sequence axis"
    if gqa and (repeat_source(att.inputs[1]) is not m["present_k"]
                or repeat_source(att.inputs[2]) is not m["present_v"]):
        return "K/V expansion is not a GQA repeat along the head axis"
    if len(att.inputs) > 4 and any(i is not None for i in att.inputs[4:]):
        return "Attention has its own past_key/past_value inputs"
    if any(o.uses() or o in att.graph.outputs for o in att.outputs[1:]):
        return "Attention's present/qk outputs are used"
    return None


def _fuse(graph: ir.Graph, m: Match) -> bool:
    """Replace the match by one Attention node; True when the GQA repeat was folded."""
    k, v = m["k"], m["v"]
    kv, vv = repeat_source(k), repeat_source(v)
    folded = kv is not None
    if folded:
        k, v = kv, vv
    mask = keep_mask(m) if m["masked"] else None
    if m["masked"] and mask is None:
        mask = m["mask"]
    attrs = [ir.AttrFloat32("scale", scale_of(m)), ir.AttrInt64("is_causal", 0)]
    if m["capped"]:
        attrs.append(ir.AttrFloat32("softcap", softcap_of(m)))
    precision = _softmax_precision(m)
    if precision:
        attrs.append(ir.AttrInt64("softmax_precision", precision))
    inputs = [m["q"], k, v] + ([mask] if mask is not None else [])
    old = m.root.outputs[0]
    node = ir.Node("", "Attention", inputs, attrs, num_outputs=1,
                   name=f"{m.root.name or 'attention'}_fused")
    node.outputs[0].name = old.name
    node.outputs[0].shape, node.outputs[0].type = old.shape, old.type
    ir.convenience.replace_nodes_and_values(graph, m.root, list(m.nodes), [node], [old], [node.outputs[0]])
    return folded


def annotate(model: ir.Model) -> None:
    """Give Constant nodes' outputs their const_value (TorchScript graphs keep scalars in Constants)
    and values their types and shapes (ONNX shape inference, large weights left out of it)."""
    from onnx_ir.passes.common import ShapeInferencePass
    from onnxscript.optimizer import basic_constant_propagation

    basic_constant_propagation(model.graph)
    ShapeInferencePass(strict_mode=False)(model)


@register("fuse_attention", FuseAttentionParams, exact=True)
def fuse_attention(model: ir.Model, params: FuseAttentionParams | None = None,
                   ctx: PassContext | None = None) -> PassResult:
    """Unfused attention (TorchScript, opset < 23, eager) -> ONNX Attention; GQA repeat folded."""
    existing = sum(1 for n in model.graph if n.op_type == "Attention" and n.domain == "")
    if not any(n.op_type == "Softmax" for n in model.graph):  # nothing unfused: leave the graph as it is
        return PassResult({"attention_fused": 0, "gqa_folded": 0, "already_fused": existing, "not_fused": 0})
    annotate(model)
    found, rejected = match.find(model, UnfusedAttention())
    if found:
        ensure_opset(model, MIN_OPSET)
    folded = 0
    for m in found:  # collect the matches first, then change the graph
        folded += _fuse(model.graph, m)
    if found:
        remove_dead_nodes(model)
    counts = {"attention_fused": len(found), "gqa_folded": folded, "already_fused": existing,
              "not_fused": len(rejected)}
    return PassResult(counts, rejected)


__all__ = ["FuseAttentionParams", "UnfusedAttention", "fuse_attention",
           "repeat_source", "dense_kv_reason"]
