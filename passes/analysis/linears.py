"""Linear layers of an exported graph: `MatMul(x, W)` / `Gemm(x, W, b)` with a constant 2-D weight.

    x ──────────────┐                         x [.., K]
    W [K, N] ───────┴─ MatMul ─▶ y            W stored [K, N] (k_axis 0), or [N, K] behind a
    W [N, K] ─ Transpose(1,0) ─┘              Transpose or Gemm(transB=1) (k_axis 1)

Every quantization and folding pass starts from this list. The lm_head is the linear whose output
is a graph output; passes leave it (and embeddings, norms) in high precision unless told otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.match import Match, Rejection, Rule

FLOAT_TYPES = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclass(frozen=True)
class Linear:
    node: ir.Node
    x: ir.Value                 # the activation the node reads [.., K]
    k_axis: int                 # axis of `weight` that is K (input channels)
    transposed_by: ir.Node | None  # the Transpose between weight and node, if any
    bias: ir.Value | None       # Gemm's C
    is_lm_head: bool

    @property
    def reader(self) -> ir.Node:
        """The node that reads the weight constant (the Transpose, if there is one)."""
        return self.transposed_by or self.node

    @property
    def w_index(self) -> int:
        return 0 if self.transposed_by is not None else 1

    @property
    def weight(self) -> ir.Value:
        """The current weight constant, [K, N] or [N, K] (read from the graph, so never stale)."""
        return self.reader.inputs[self.w_index]

    @property
    def name(self) -> str:
        return self.node.name or self.weight.name

    @property
    def k(self) -> int:
        return int(self.weight.shape[self.k_axis])

    @property
    def n(self) -> int:
        return int(self.weight.shape[1 - self.k_axis])

    def weight_kn(self) -> np.ndarray:
        """The weight as [K, N] float32 (a copy when stored transposed)."""
        w = self.weight.const_value.numpy().astype(np.float32)
        return w if self.k_axis == 0 else w.T


class LinearRule(Rule):
    """A MatMul/Gemm whose second input is a constant 2-D float weight (optionally transposed)."""

    def __init__(self, gemm: bool, transposed: bool):
        self.gemm, self.transposed = gemm, transposed
        self.name = ("Gemm" if gemm else "MatMul") + ("(x, Transpose(W))" if transposed else "(x, W)")

    def pattern(self, op, x, w):
        weight = op.Transpose(w, _allow_other_attributes=True) if self.transposed else w
        if self.gemm:
            return op.Gemm(x, weight, _allow_other_inputs=True, _allow_other_attributes=True)
        return op.MatMul(x, weight)

    def check(self, m: Match) -> str | None:
        w = m["w"]
        tensor = match.constant(w)
        if tensor is None:
            return f"weight {w.name} is computed, not a constant"
        if len(tensor.shape) != 2:
            return f"weight {w.name} has rank {len(tensor.shape)}, not 2"
        if tensor.dtype not in FLOAT_TYPES:
            return f"weight {w.name} is {tensor.dtype}, already quantized or not float"
        transpose = next((n for n in m.nodes if n.op_type == "Transpose"), None)
        if transpose is not None:
            perm = match.attr(transpose, "perm")
            if perm is not None and list(perm) != [1, 0]:
                return f"weight transpose has perm {perm}"
            if len(transpose.outputs[0].uses()) != 1:
                return "the transposed weight has other readers"
        if self.gemm:
            node = m.root
            if match.attr(node, "transA", 0) != 0:
                return "Gemm with transA=1"
            if match.attr(node, "alpha", 1.0) != 1.0 or match.attr(node, "beta", 1.0) != 1.0:
                return "Gemm with alpha/beta != 1"
        return None


RULES = [LinearRule(gemm, t) for gemm in (False, True) for t in (False, True)]


def _as_linear(m: Match, graph: ir.Graph) -> Linear:
    node = m.root
    transpose = next((n for n in m.nodes if n.op_type == "Transpose"), None)
    k_axis = 0 if transpose is None else 1
    if node.op_type == "Gemm" and match.attr(node, "transB", 0):
        k_axis = 1 - k_axis
    bias = node.inputs[2] if node.op_type == "Gemm" and len(node.inputs) > 2 else None
    out = node.outputs[0]
    return Linear(node, m["x"], k_axis, transpose, bias, out in graph.outputs)


def find_linears(model: ir.Model) -> tuple[list[Linear], list[Rejection]]:
    """All linears in graph order, and the MatMul/Gemm nodes that are not linears, with reasons."""
    matches, rejections = match.find_all(model, RULES)
    linears = [_as_linear(m, model.graph) for m in matches]
    seen = {id(lin.node) for lin in linears} | {id(r.root) for r in rejections}
    for node in model.graph:  # MatMuls of two activations (attention without a fused op, ...)
        if node.op_type in ("MatMul", "Gemm") and id(node) not in seen:
            rejections.append(Rejection("linear", node.name, "both inputs are activations", node))
    return linears, rejections


def select(linears: list[Linear], include_lm_head: bool) -> tuple[list[Linear], list[Rejection]]:
    """The linears a quantization pass should touch, and the skipped ones with the reason."""
    chosen, skipped = [], []
    for lin in linears:
        if lin.is_lm_head and not include_lm_head:
            skipped.append(Rejection("select", lin.name, "lm_head stays high precision "
                                     "(pass include_lm_head=true to quantize it)", lin.node))
        else:
            chosen.append(lin)
    return chosen, skipped
