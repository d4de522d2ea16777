"""fuse_matmul: sibling MatMuls that read the same activation -> one MatMul over their concatenated
weights, then a Split (horizontal fusion, as XLA and TVM do it).

    x ─ MatMul(W1 [K, N1]) ─ y1              x ─ MatMul([W1|W2] [K, N1+N2]) ─ Split(N1, N2) ─ y1
    x ─ MatMul(W2 [K, N2]) ─ y2      =>                                                    └ y2

At decode (one token) every MatMul is a matrix-vector product bounded by reading its weight; one
larger one streams the same bytes in one launch (the MLP's gate and up projections: two 2-D weights
of the same K and dtype). Exact: each output column is the same dot product. Weights must be
constant, 2-D and of one dtype; the group keeps the order in which the graph first reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from enginesmith.passes.machinery.edit import (
    Namer,
    add_initializer,
    add_node,
    drop_unused_initializers,
)
from enginesmith.passes.machinery.match import Rejection
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class FuseMatMulParams:
    max_group: int = 4  # at most this many siblings fused into one MatMul

    def __post_init__(self):
        if self.max_group < 2:
            raise ValueError("max_group must be >= 2")


def _weight(node: ir.Node) -> ir.Value | None:
    w = node.inputs[1]
    if w is None or w.const_value is None or len(w.const_value.shape) != 2:
        return None
    return w


def _groups(graph: ir.Graph, max_group: int) -> tuple[list[list[ir.Node]], list[Rejection]]:
    groups, rejected = [], []
    seen: set[int] = set()
    for node in graph:
        if node.op_type != "MatMul" or node.domain != "" or id(node) in seen or _weight(node) is None:
            continue
        x = node.inputs[0]
        siblings = [u.node for u in x.uses()
                    if u.node.op_type == "MatMul" and u.node.domain == "" and u.idx == 0 and _weight(u.node) is not None]
        siblings = list({id(n): n for n in siblings}.values())
        if len(siblings) < 2:
            continue
        first = _weight(siblings[0]).const_value
        same = [n for n in siblings if _weight(n).const_value.dtype == first.dtype
                and _weight(n).const_value.shape[0] == first.shape[0]]
        for n in siblings:
            seen.add(id(n))
            if n not in same:
                rejected.append(Rejection("fuse_matmul", n.name or "MatMul", "weight of another dtype or K", n))
        order = {id(n): i for i, n in enumerate(graph)}
        same.sort(key=lambda n: order[id(n)])
        for start in range(0, len(same), max_group):
            chunk = same[start:start + max_group]
            if len(chunk) >= 2:
                groups.append(chunk)
    return groups, rejected


def _fuse(graph: ir.Graph, namer: Namer, nodes: list[ir.Node]) -> None:
    weights = [_weight(n).const_value.numpy() for n in nodes]
    widths = [w.shape[1] for w in weights]
    fused_w = add_initializer(graph, namer, f"{nodes[0].name or 'matmul'}.fused_weight", np.concatenate(weights, axis=1))
    x = nodes[0].inputs[0]
    outs = [n.outputs[0] for n in nodes]
    shape = None
    if outs[0].shape is not None:
        shape = ir.Shape(list(outs[0].shape)[:-1] + [sum(widths)])
    y = add_node(graph, namer, "MatMul", [x, fused_w], like=outs[0], shape=shape, before=nodes[0],
                 base=f"{nodes[0].name or 'matmul'}_fused")
    sizes = add_initializer(graph, namer, f"{nodes[0].name or 'matmul'}.split", np.asarray(widths, np.int64))
    split = ir.Node("", "Split", [y, sizes], [ir.AttrInt64("axis", -1)], num_outputs=len(nodes),
                    name=namer(f"{nodes[0].name or 'matmul'}_split"))
    graph.insert_before(nodes[0], split)
    for new, old in zip(split.outputs, outs):
        new.name, new.type, new.shape = namer(f"{old.name}_part"), old.type, old.shape
        for i, out in enumerate(graph.outputs):
            if out is old:
                graph.outputs[i] = new
        ir.convenience.replace_all_uses_with(old, new)
    for n in nodes:
        graph.remove(n, safe=True)


@register("fuse_matmul", FuseMatMulParams, exact=True)
def fuse_matmul(model: ir.Model, params: FuseMatMulParams | None = None,
                ctx: PassContext | None = None) -> PassResult:
    """Sibling MatMuls on one activation -> one MatMul on concatenated weights + Split."""
    params = params or FuseMatMulParams()
    groups, rejected = _groups(model.graph, params.max_group)
    namer = Namer(model.graph)
    for nodes in groups:
        _fuse(model.graph, namer, nodes)
    drop_unused_initializers(model.graph)
    return PassResult({"fused_groups": len(groups), "matmuls_fused": sum(len(g) for g in groups)}, rejected)


__all__ = ["FuseMatMulParams", "fuse_matmul"]
