"""skip_rmsnorm: residual Add + RMSNormalization -> com.microsoft.SkipSimplifiedLayerNormalization.

    a ─┐                                  a ─┐
       Add ── sum ──▶ (next residual)  =>    SkipSimplifiedLayerNormalization(a, b, gamma) ─ y
    b ─┘  └─ RMSNormalization(gamma) ─ y  b ─┘                       └─ input_skip_sum ──▶ (next residual)

One kernel instead of two per norm on ORT CUDA (two per decoder layer); with fp16 both compute
the norm in fp32 (stash_type 1). The first norm of a decoder (on the embeddings, no Add before it)
stays an RMSNormalization. Exact up to the float rounding of the norm's reduction order.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.match import Match, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class SkipRmsNormParams:
    pass


class ResidualRmsNorm(Rule):
    name = "residual_rmsnorm"

    def pattern(self, op, a, b, gamma):
        return op.RMSNormalization(op.Add(a, b, _outputs=["sum"]), gamma, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        if match.attr(m.root, "axis", -1) not in (-1, 2):
            return "normalizes over more than the last axis"
        if match.attr(m.root, "stash_type", 1) != 1:
            return "stash_type is not fp32"
        gamma = match.constant(m["gamma"])
        if gamma is None or len(gamma.shape) != 1:
            return "gamma is not a constant vector"
        for name in ("a", "b"):
            shape = m[name].shape
            if shape is not None and shape.rank() != 3:
                return f"{name} is rank {shape.rank()}, not [B, S, E]"
        if m["a"].shape is not None and m["b"].shape is not None and m["a"].shape != m["b"].shape:
            return "the residual's inputs differ in shape (a broadcast Add)"
        return None


def _lower(graph: ir.Graph, m: Match) -> None:
    norm = m.root
    add = m["sum"].producer()  # its inputs now, after earlier rewrites moved them to fused sums
    node = ir.Node(MS_DOMAIN, "SkipSimplifiedLayerNormalization", [add.inputs[0], add.inputs[1], m["gamma"]],
                   [ir.AttrFloat32("epsilon", float(match.attr(norm, "epsilon", 1e-5)))], num_outputs=4,
                   name=f"{norm.name or 'rmsnorm'}_skip")
    graph.insert_before(norm, node)
    y, mean, inv_std, total = node.outputs
    old_y, old_sum = norm.outputs[0], m["sum"]
    mean.name, inv_std.name = "", ""  # optional outputs left out
    y.name, y.type, y.shape = f"{old_y.name}_skip", old_y.type, old_y.shape
    total.name, total.type, total.shape = f"{old_sum.name}_skip", old_sum.type, old_sum.shape
    ir.convenience.replace_all_uses_with(old_y, y)
    ir.convenience.replace_all_uses_with(old_sum, total)  # the next residual reads the fused sum
    for i, out in enumerate(graph.outputs):
        if out is old_y:
            graph.outputs[i] = y
        elif out is old_sum:
            graph.outputs[i] = total


@register("skip_rmsnorm", SkipRmsNormParams, exact=True)
def skip_rmsnorm(model: ir.Model, params: SkipRmsNormParams | None = None,
                 ctx: PassContext | None = None) -> PassResult:
    """Residual Add + RMSNormalization -> com.microsoft.SkipSimplifiedLayerNormalization."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    found, rejected = match.find(model, ResidualRmsNorm())
    for m in found:  # collect the matches first, then change the graph
        _lower(model.graph, m)
    if found:
        RemoveUnusedNodesPass()(model)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return PassResult({"skip_rmsnorm": len(found), "not_fused": len(rejected)}, rejected)


__all__ = ["SkipRmsNormParams", "ResidualRmsNorm", "skip_rmsnorm"]
