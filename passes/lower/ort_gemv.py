"""ort_gemv: decode matrix products -> enginesmith's ORT custom ops (plugins/ort_ops, domain com.enginesmith).

    x ─ FusedMatMul(W [N, K], transB=1) ─ y                  x ─ Gemv(W) ─ y
    x ─ MatMulNBits(B, scales; bits=4, symmetric) ─ y         x ─ GemvQ4(B, scales) ─ y
    x ─ gate ─ Sigmoid ─ Mul ─┐                              x ─ SwiGluGemv(Wg, Wu) ─ y
    x ─ up ───────────────────Mul ─ y                         (SwiGluGemvQ4 for int4 weights)

Then (norm=True) the RMSNorm that feeds a product, when nothing else reads the normalized x, is folded
into it, one kernel less per norm (each block normalizes x itself, see plugins/ort_ops/gemv.h):

    a, b ─ SkipSimplifiedLayerNormalization(gamma) ─ y ─ <op> ─ z     a, b ─ SkipRmsNorm<op>(gamma) ─ z
                                                  └─ sum (residual)              └─ sum (residual)
    x ─ RMSNormalization(gamma) ─ y ─ <op> ─ z                         x ─ RmsNorm<op>(gamma) ─ z

ORT CUDA runs a batch-1 decode GEMV through cuBLAS at 40-76 % of the copy bandwidth (fp16) and its
MatMulNBits kernel at under 30 % (int4); the custom ops stream the weights near the bandwidth and
fold the MLP's gate, up, SiLU and Mul into one kernel (benchmarks/gpu/README.md has the figures).
Both products of a SwiGLU must read the same x and the same weight format. fp16 activations only.
Not exact: the kernels sum in another order (fp32 partials), so the pipeline checks with a tolerance.
The graph then needs the library at run time (plugins/ort_ops.py registers it).

Three rule families, one stage each (a stage matches the previous stage's ops), each match rewritten
after all are found; every site a rule rejects is reported with its reason (PassResult.skipped).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from enginesmith.core.io_names import MS_DOMAIN, ORT_OPS_DOMAIN as DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, replace_value, to_attrs
from enginesmith.passes.machinery.match import Match, Rejection, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

PRODUCTS = ("Gemv", "SwiGluGemv", "GemvQ4", "SwiGluGemvQ4")
Q4_ATTRS = ("K", "N", "block_size")
BLOCK_SIZES = (32, 64, 128, 256)
MAX_NORM_K = 24576  # the fused norm keeps a row of x in 48 KiB of shared memory


@dataclass(frozen=True)
class OrtGemvParams:
    swiglu: bool = True  # fuse gate/up/SiLU/Mul into one op
    norm: bool = True    # fold the RMSNorm before a product into it


def _is_fp16(value: ir.Value | None) -> bool:
    return value is not None and value.type is not None and value.dtype == ir.DataType.FLOAT16


# ---- stage 1: one product -> Gemv / GemvQ4 ----------------------------------------------------------

class DenseProduct(Rule):
    """x ─ com.microsoft.FusedMatMul(W [N, K], transB=1) -> Gemv(x, W)."""

    name = "fused_matmul->gemv"

    def pattern(self, op, x, w):
        return op.FusedMatMul(x, w, _domain=MS_DOMAIN, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        node, w = m.root, m["w"]
        if not _is_fp16(m["x"]):
            return "activations are not fp16"
        trans = tuple(match.attr(node, a, d) for a, d in (("transA", 0), ("transB", 0), ("alpha", 1.0)))
        if trans != (0, 1, 1.0) or any(match.attr(node, a, 0) for a in ("transBatchA", "transBatchB")):
            return f"not x @ W^T (transA, transB, alpha = {trans}, or a batch transpose)"
        if w is None or w.const_value is None or len(w.const_value.shape) != 2 or not _is_fp16(w):
            return "the weight is not a constant fp16 [N, K] matrix"
        if w.const_value.shape[1] % 8:
            return f"K = {w.const_value.shape[1]} is not a multiple of 8"
        return None


class Int4Product(Rule):
    """x ─ com.microsoft.MatMulNBits(B, scales; bits=4, no zero points) -> GemvQ4(x, B, scales)."""

    name = "matmul_nbits->gemv_q4"

    def pattern(self, op, x, b, scales):
        return op.MatMulNBits(x, b, scales, _domain=MS_DOMAIN, _allow_other_inputs=True,
                              _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        node = m.root
        if not _is_fp16(m["x"]):
            return "activations are not fp16"
        if match.attr(node, "bits", 4) != 4:
            return f"bits={match.attr(node, 'bits')}, the op reads int4 only"
        if m["b"] is None or m["scales"] is None or any(v is not None for v in node.inputs[3:]):
            return "has zero points, g_idx or a bias (symmetric int4 only)"
        k, bs = match.attr(node, "K"), match.attr(node, "block_size")
        if bs not in BLOCK_SIZES or k % bs:
            return f"block_size {bs} is not one of {BLOCK_SIZES} dividing K = {k}"
        if not _is_fp16(m["scales"]):
            return "scales are not fp16"
        return None


def _product(m: Match) -> tuple[str, list[ir.Value], dict]:
    if m.rule == DenseProduct.name:
        return "Gemv", [m["x"], m["w"]], {}
    return "GemvQ4", [m["x"], m["b"], m["scales"]], {a: match.attr(m.root, a) for a in Q4_ATTRS}


# ---- stage 2: gate, up, SiLU, Mul -> SwiGluGemv -----------------------------------------------------

class SwiGlu(Rule):
    """Mul(g * Sigmoid(g), u) with g = <gemv>(x, Wg), u = <gemv>(x, Wu) -> SwiGlu<gemv>(x, Wg, Wu); the
    variants are the two operand orders of each Mul."""

    def __init__(self, q4: bool, silu_first: bool, gate_first: bool):
        self.q4, self.silu_first, self.gate_first = q4, silu_first, gate_first
        self.name = f"swiglu{'_q4' if q4 else ''}[{int(silu_first)}{int(gate_first)}]"

    def pattern(self, op, x, wg, sg, wu, su):
        if self.q4:
            g = op.GemvQ4(x, wg, sg, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["g"])
            u = op.GemvQ4(x, wu, su, _domain=DOMAIN, _allow_other_attributes=True, _outputs=["u"])
        else:
            g = op.Gemv(x, wg, _domain=DOMAIN, _outputs=["g"])
            u = op.Gemv(x, wu, _domain=DOMAIN, _outputs=["u"])
        sig = op.Sigmoid(g)
        silu = op.Mul(g, sig) if self.gate_first else op.Mul(sig, g)
        return op.Mul(silu, u) if self.silu_first else op.Mul(u, silu)

    def check(self, m: Match) -> str | None:
        gate, up = m["g"].producer(), m["u"].producer()
        if gate is up:
            return "gate and up are one product"
        if self.q4 and any(match.attr(gate, a) != match.attr(up, a) for a in Q4_ATTRS):
            return "gate and up differ in K, N or block_size"
        return match.private_interior(m)


SWIGLU_RULES = [SwiGlu(q4, s, g) for q4 in (False, True) for s in (True, False) for g in (True, False)]


def _swiglu(m: Match) -> tuple[str, list[ir.Value], dict]:
    gate = m["g"].producer()
    if gate.op_type == "Gemv":
        return "SwiGluGemv", [m["x"], m["wg"], m["wu"]], {}
    return "SwiGluGemvQ4", [m["x"], m["wg"], m["sg"], m["wu"], m["su"]], {a: match.attr(gate, a) for a in Q4_ATTRS}


# ---- stage 3: RMSNorm + product -> RmsNorm<op> / SkipRmsNorm<op> -------------------------------------

class NormIntoProduct(Rule):
    """y = RMSNorm(x) read only as the x of one product op -> (Skip)RmsNorm<op>(norm inputs, weights)."""

    def __init__(self, skip: bool, product: str):
        self.skip, self.product = skip, product
        self.name = f"{'skip_' if skip else ''}rmsnorm+{product}"

    def pattern(self, op, x, gamma):
        if self.skip:
            y = op.SkipSimplifiedLayerNormalization(x, _domain=MS_DOMAIN, _allow_other_inputs=True,
                                                    _allow_other_attributes=True, _outputs=["y"])
        else:
            y = op.RMSNormalization(x, gamma, _allow_other_attributes=True, _outputs=["y"])
        return getattr(op, self.product)(y, _domain=DOMAIN, _allow_other_inputs=True, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        norm, y = m["y"].producer(), m["y"]
        inputs = list(norm.inputs)
        if self.skip:
            if len(inputs) != 3 or any(v is None for v in inputs):
                return "the skip norm has a bias (or lacks an input)"
            if any(v is not None and v.uses() for v in norm.outputs[1:3]):
                return "the norm's mean / inv_std outputs are used"
        else:
            rank = m["x"].shape.rank() if m["x"].shape is not None else None
            if rank is None:
                return "x has no known rank"
            if match.attr(norm, "axis", -1) not in (-1, rank - 1) or match.attr(norm, "stash_type", 1) != 1:
                return "normalizes over more than the last axis, or not in fp32"
        if any(not _is_fp16(v) for v in inputs):
            return "the norm's inputs are not fp16"
        gamma = match.constant(inputs[-1])
        if gamma is None or len(gamma.shape) != 1:
            return "gamma is not a constant vector"
        if gamma.shape[0] > MAX_NORM_K or gamma.shape[0] % 8:
            return f"hidden size {gamma.shape[0]} is over {MAX_NORM_K} or not a multiple of 8"
        if len(y.uses()) != 1 or y.is_graph_output():
            return "the normalized x is also read elsewhere"
        return None


NORM_RULES = [NormIntoProduct(skip, p) for skip in (True, False) for p in PRODUCTS]


def _norm_fold(m: Match) -> tuple[str, list[ir.Value], dict, ir.Value | None]:
    """(op, inputs, attrs, the residual sum the new op outputs or None) of a folded norm."""
    norm, product = m["y"].producer(), m.root
    total = None
    if norm.op_type == "SkipSimplifiedLayerNormalization":
        total = norm.outputs[3] if len(norm.outputs) > 3 else None
        if total is not None and not total.uses() and not total.is_graph_output():
            total = None
    attrs = {a.name: a.value for a in product.attributes.values()}
    attrs["epsilon"] = float(match.attr(norm, "epsilon", 1e-5))
    prefix = "SkipRmsNorm" if norm.op_type == "SkipSimplifiedLayerNormalization" else "RmsNorm"
    return prefix + product.op_type, list(norm.inputs) + list(product.inputs[1:]), attrs, total


# ---- the pass -------------------------------------------------------------------------------------

def _replace(graph: ir.Graph, old: ir.Node, op: str, inputs: list[ir.Value], attrs: dict, namer: Namer,
             out_of: ir.Value, sum_of: ir.Value | None = None) -> ir.Node:
    """A new `op` node before `old` whose output takes `out_of`'s place (and its second output
    `sum_of`'s, for the SkipRmsNorm ops)."""
    node = ir.Node(DOMAIN, op, inputs, to_attrs(attrs), num_outputs=2 if op.startswith("SkipRmsNorm") else 1,
                   name=namer(f"{old.name or op}_{op.lower()}"))
    graph.insert_before(old, node)
    replace_value(graph, out_of, node.outputs[0], namer(f"{out_of.name}_{op.lower()}"))
    if sum_of is not None:
        replace_value(graph, sum_of, node.outputs[1], namer(f"{sum_of.name}_{op.lower()}"))
    elif len(node.outputs) > 1:
        node.outputs[1].name = namer(f"{node.name}_sum")  # a last norm's residual: nothing reads it
    return node


def _once_per_site(rejected: list[Rejection]) -> list[Rejection]:
    """One rejection per root node (operand-order variants may each reject the same site)."""
    seen, out = set(), []
    for r in rejected:
        if id(r.root) not in seen:
            seen.add(id(r.root))
            out.append(r)
    return out


@register("ort_gemv", OrtGemvParams, exact=False)
def ort_gemv(model: ir.Model, params: OrtGemvParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """fp16 FusedMatMul(transB) and int4 MatMulNBits -> com.enginesmith Gemv ops; SwiGLU MLPs and the
    RMSNorms before products fused."""
    params = params or OrtGemvParams()
    graph = model.graph
    namer = Namer(graph)
    counts = {"gemv": 0, "gemv_q4": 0, "swiglu": 0, "norm": 0}
    found, skipped = match.find_all(model, [DenseProduct(), Int4Product()])
    for m in found:  # collect the matches first, then change the graph
        op, inputs, attrs = _product(m)
        _replace(graph, m.root, op, inputs, attrs, namer, m.root.outputs[0])
        graph.remove(m.root, safe=True)
        counts["gemv_q4" if op == "GemvQ4" else "gemv"] += 1
    if params.swiglu:
        found, rejected = match.find_all(model, SWIGLU_RULES)
        skipped += _once_per_site(rejected)
        for m in found:
            op, inputs, attrs = _swiglu(m)
            _replace(graph, m.root, op, inputs, attrs, namer, m.root.outputs[0])
            counts["swiglu"] += 1  # gate, up, Sigmoid and the Muls are now unused: removed below
    if params.norm:
        RemoveUnusedNodesPass()(model)  # the SwiGLUs' leftovers must not count as readers of a norm
        found, rejected = match.find_all(model, NORM_RULES)
        skipped += rejected
        for m in found:
            op, inputs, attrs, total = _norm_fold(m)
            _replace(graph, m.root, op, inputs, attrs, namer, m.root.outputs[0], total)
            graph.remove(m.root, safe=True)
            counts["norm"] += 1  # the norm is now unused: removed below
    if any(counts.values()):
        RemoveUnusedNodesPass()(model)
        model.opset_imports.setdefault(DOMAIN, 1)
    return PassResult(counts, skipped)


__all__ = ["DOMAIN", "OrtGemvParams", "DenseProduct", "Int4Product", "SwiGlu", "NormIntoProduct", "ort_gemv"]
