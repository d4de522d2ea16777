"""untie_lm_head: MatMul(x, Transpose(W)) with a constant W -> MatMul(x, W^T) with its own initializer.

    embedding W [V, E] ─┬─ Gather(ids)                  W [V, E] ─ Gather(ids)
                        └─ Transpose ─ MatMul(x)   =>   W^T [E, V] ─ MatMul(x)      (lm_head)

A tied lm_head reads the embedding through a Transpose. ORT folds it at load time anyway (a second
copy in memory); doing it in the graph lets the weight-only quantization passes see the lm_head as
an ordinary [K, N] linear (quantize_w4a16 include_lm_head=true -> lower_ort -> MatMulNBits), while
the embedding lookup keeps its full-precision table. Exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, add_initializer
from enginesmith.passes.machinery.match import Match, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class UntieLmHeadParams:
    pass


class TransposedConstantLinear(Rule):
    name = "transposed_constant_linear"

    def pattern(self, op, x, w):
        return op.MatMul(x, op.Transpose(w, _allow_other_attributes=True, _outputs=["wt"]))

    def check(self, m: Match) -> str | None:
        w = match.constant(m["w"])
        if w is None or len(w.shape) != 2:
            return "the transposed weight is not a constant matrix"
        perm = match.attr(m["wt"].producer(), "perm", None)
        if perm is not None and list(perm) != [1, 0]:
            return "not a plain 2-D transpose"
        return None


@register("untie_lm_head", UntieLmHeadParams, exact=True)
def untie_lm_head(model: ir.Model, params: UntieLmHeadParams | None = None,
                  ctx: PassContext | None = None) -> PassResult:
    """MatMul(x, Transpose(W const)) -> MatMul(x, W^T const) (a tied lm_head gets its own matrix)."""
    found, rejected = match.find(model, TransposedConstantLinear())
    namer = Namer(model.graph)
    for m in found:  # collect the matches first, then change the graph
        w = m["w"]
        wt = add_initializer(model.graph, namer, f"{w.name}.T", np.ascontiguousarray(w.const_value.numpy().T))
        m.root.replace_input_with(1, wt)
    if found:
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(model)
    return PassResult({"untied": len(found), "not_untied": len(rejected)}, rejected)


__all__ = ["UntieLmHeadParams", "untie_lm_head"]
