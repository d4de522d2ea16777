"""matmul_transb: MatMul(x, W [K, N]) -> com.microsoft.FusedMatMul(x, Wᵀ [N, K], transB=1).

    x ─ MatMul(W [K, N]) ─ y              x ─ FusedMatMul(Wt [N, K], transB=1) ─ y
    x ─ MatMul(Transpose(E [N, K])) ─ y   x ─ FusedMatMul(E [N, K], transB=1) ─ y   (a tied lm_head)

The same product with the weight stored one output row after another (K contiguous per output, as
nn.Linear keeps it): at decode, cuBLAS then runs each output as a contiguous dot product instead of a
strided one (benchmarks/gpu/gemv_layouts.py measures both on the GPU). A tied lm_head reads the
embedding table itself, with no transposed copy. Exact; weights must be constant and 2-D.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.machinery.edit import Namer, add_initializer, drop_unused_initializers, replace_value
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class MatMulTransBParams:
    pass


def _source(w: ir.Value) -> tuple[ir.Value, bool] | None:
    """(constant to read, already [N, K]) for a MatMul weight input, or None."""
    if w.const_value is not None and len(w.const_value.shape) == 2:
        return w, False
    node = w.producer()
    if node is not None and node.op_type == "Transpose" and node.domain == "":
        src = node.inputs[0]
        perm = node.attributes.get("perm")
        if src.const_value is not None and len(src.const_value.shape) == 2 and \
                (perm is None or list(perm.as_ints()) == [1, 0]):
            return src, True
    return None


@register("matmul_transb", MatMulTransBParams, exact=True)
def matmul_transb(model: ir.Model, params: MatMulTransBParams | None = None,
                  ctx: PassContext | None = None) -> PassResult:
    """MatMul with a constant weight -> FusedMatMul(transB=1) on the weight stored [N, K]."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    namer = Namer(graph)
    transposed: dict[int, ir.Value] = {}  # one [N, K] copy per shared weight
    counts = {"fused_matmul_transb": 0, "tied_transpose_removed": 0}
    for node in list(graph):
        if node.op_type != "MatMul" or node.domain != "" or node.inputs[1] is None:
            continue
        found = _source(node.inputs[1])
        if found is None:
            continue
        src, is_nk = found
        if is_nk:
            weight = src
            counts["tied_transpose_removed"] += 1
        else:
            weight = transposed.get(id(src))
            if weight is None:
                array = np.ascontiguousarray(src.const_value.numpy().T)
                weight = transposed[id(src)] = add_initializer(graph, namer, f"{src.name}.t", array)
        fused = ir.Node(MS_DOMAIN, "FusedMatMul", [node.inputs[0], weight],
                        [ir.AttrInt64("transA", 0), ir.AttrInt64("transB", 1), ir.AttrFloat32("alpha", 1.0)],
                        num_outputs=1, name=namer(f"{node.name or 'matmul'}_transb"))
        graph.insert_before(node, fused)
        old = node.outputs[0]
        replace_value(graph, old, fused.outputs[0], namer(f"{old.name}_t"))
        graph.remove(node, safe=True)
        counts["fused_matmul_transb"] += 1
    if counts["fused_matmul_transb"]:
        RemoveUnusedNodesPass()(model)
        drop_unused_initializers(graph)
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    return PassResult(counts)


__all__ = ["MatMulTransBParams", "matmul_transb"]
