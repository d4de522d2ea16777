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
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, replace_value, to_attrs
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

DOMAIN = "com.enginesmith"
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class OrtGemvParams:
    swiglu: bool = True  # fuse gate/up/SiLU/Mul into one op
    norm: bool = True    # fold the RMSNorm before a product into it


def _is_fp16(value: ir.Value) -> bool:
    return value.type is not None and value.dtype == ir.DataType.FLOAT16


def _gemv_inputs(node: ir.Node) -> tuple[str, list[ir.Value], dict] | None:
    """(op, inputs, attrs) of the custom op that replaces `node`, or None if it does not apply."""
    x = node.inputs[0]
    if node.domain != MS_DOMAIN or x is None or not _is_fp16(x):
        return None
    if node.op_type == "FusedMatMul":
        w = node.inputs[1]
        if (match.attr(node, "transA", 0), match.attr(node, "transB", 0), match.attr(node, "alpha", 1.0)) != (0, 1, 1.0) or \
                any(match.attr(node, a, 0) for a in ("transBatchA", "transBatchB")):
            return None
        if w is None or w.const_value is None or len(w.const_value.shape) != 2 or not _is_fp16(w):
            return None
        if w.const_value.shape[1] % 8:
            return None
        return "Gemv", [x, w], {}
    if node.op_type == "MatMulNBits":
        ins = node.inputs  # A, B, scales only: no zero points, g_idx or bias
        if match.attr(node, "bits", 4) != 4 or len(ins) < 3 or any(v is None for v in ins[:3]) or \
                any(v is not None for v in ins[3:]):
            return None
        K, N, bs = match.attr(node, "K"), match.attr(node, "N"), match.attr(node, "block_size")
        if bs not in (32, 64, 128, 256) or K % bs or not _is_fp16(node.inputs[2]):
            return None
        return "GemvQ4", [x, node.inputs[1], node.inputs[2]], {"K": K, "N": N, "block_size": bs}
    return None


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


def _only_uses(value: ir.Value, n: int) -> list[ir.Node] | None:
    users = [u for u, _ in value.uses()]
    return users if len(users) == n and not value.is_graph_output() else None


def _swiglu(mul: ir.Node) -> tuple[ir.Node, ir.Node] | None:
    """For y = Mul(silu(g), u) with g, u from Gemv ops on the same x, used nowhere else: (gate, up)."""
    if mul.op_type != "Mul" or mul.domain != "":
        return None
    for silu_v, up_v in ((mul.inputs[0], mul.inputs[1]), (mul.inputs[1], mul.inputs[0])):
        silu = silu_v.producer() if silu_v is not None else None
        up = up_v.producer() if up_v is not None else None
        if silu is None or up is None or silu.op_type != "Mul" or silu.domain != "" or up.domain != DOMAIN:
            continue
        for g_v, sig_v in ((silu.inputs[0], silu.inputs[1]), (silu.inputs[1], silu.inputs[0])):
            sig, gate = sig_v.producer(), g_v.producer()
            if sig is None or gate is None or sig.op_type != "Sigmoid" or sig.inputs[0] is not g_v:
                continue
            if gate.domain != DOMAIN or gate.op_type != up.op_type or gate.op_type not in ("Gemv", "GemvQ4"):
                continue
            if gate.inputs[0] is not up.inputs[0] or gate is up:
                continue
            if gate.op_type == "GemvQ4" and any(match.attr(gate, a) != match.attr(up, a) for a in ("K", "N", "block_size")):
                continue
            if _only_uses(g_v, 2) is None or _only_uses(silu_v, 1) is None or _only_uses(up_v, 1) is None or \
                    _only_uses(sig_v, 1) is None:
                continue
            return gate, up
    return None


PRODUCTS = ("Gemv", "SwiGluGemv", "GemvQ4", "SwiGluGemvQ4")
MAX_NORM_K = 24576  # the fused norm keeps a row of x in 48 KiB of shared memory


def _norm_fold(norm: ir.Node) -> tuple[str, list[ir.Value], float, ir.Value | None, ir.Node] | None:
    """For an RMSNorm whose output is the x of exactly one product op and nothing else:
    (op prefix, the norm's inputs, epsilon, the residual sum it outputs or None, the product)."""
    if norm.op_type == "SkipSimplifiedLayerNormalization" and norm.domain == MS_DOMAIN:
        prefix, inputs = "SkipRmsNorm", list(norm.inputs)
        if len(inputs) != 3 or any(v is None for v in inputs):  # no bias
            return None
        if any(v is not None and v.uses() for v in norm.outputs[1:3]):  # mean, inv_std
            return None
        total = norm.outputs[3] if len(norm.outputs) > 3 else None
        if total is not None and not total.uses() and not total.is_graph_output():
            total = None
    elif norm.op_type == "RMSNormalization" and norm.domain == "":
        prefix, inputs, total = "RmsNorm", list(norm.inputs), None
        x = inputs[0] if inputs else None
        rank = x.shape.rank() if x is not None and x.shape is not None else None
        if len(inputs) != 2 or x is None or rank is None or match.attr(norm, "axis", -1) not in (-1, rank - 1) or \
                match.attr(norm, "stash_type", 1) != 1:
            return None
    else:
        return None
    gamma = match.constant(inputs[-1])
    if any(v is None or not _is_fp16(v) for v in inputs) or gamma is None or len(gamma.shape) != 1 or \
            gamma.shape[0] > MAX_NORM_K or gamma.shape[0] % 8:
        return None
    users = _only_uses(norm.outputs[0], 1)
    if users is None or users[0].domain != DOMAIN or users[0].op_type not in PRODUCTS or \
            users[0].inputs[0] is not norm.outputs[0] or any(v is norm.outputs[0] for v in users[0].inputs[1:]):
        return None
    return prefix, inputs, float(match.attr(norm, "epsilon", 1e-5)), total, users[0]


@register("ort_gemv", OrtGemvParams, exact=False)
def ort_gemv(model: ir.Model, params: OrtGemvParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """fp16 FusedMatMul(transB) and int4 MatMulNBits -> com.enginesmith Gemv ops; SwiGLU MLPs and the
    RMSNorms before products fused."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    params = params or OrtGemvParams()
    graph = model.graph
    namer = Namer(graph)
    counts = {"gemv": 0, "gemv_q4": 0, "swiglu": 0, "norm": 0}
    for node in list(graph):
        found = _gemv_inputs(node)
        if found is None:
            continue
        op, inputs, attrs = found
        _replace(graph, node, op, inputs, attrs, namer, node.outputs[0])
        graph.remove(node, safe=True)
        counts["gemv_q4" if op == "GemvQ4" else "gemv"] += 1
    if params.swiglu:
        for node in list(graph):
            fused = _swiglu(node)
            if fused is None:
                continue
            gate, up = fused
            if gate.op_type == "Gemv":
                op, inputs = "SwiGluGemv", [gate.inputs[0], gate.inputs[1], up.inputs[1]]
                attrs = {}
            else:
                op, inputs = "SwiGluGemvQ4", [gate.inputs[0], gate.inputs[1], gate.inputs[2], up.inputs[1],
                                              up.inputs[2]]
                attrs = {a: match.attr(gate, a) for a in ("K", "N", "block_size")}
            _replace(graph, node, op, inputs, attrs, namer, node.outputs[0])
            counts["swiglu"] += 1  # gate, up, Sigmoid and the Muls are now unused: removed below
    if params.norm:
        RemoveUnusedNodesPass()(model)  # the SwiGLUs' leftovers must not count as readers of a norm
        for node in list(graph):
            folded = _norm_fold(node)
            if folded is None:
                continue
            prefix, norm_inputs, eps, total, product = folded
            attrs = {a.name: a.value for a in product.attributes.values()}
            _replace(graph, product, prefix + product.op_type, norm_inputs + list(product.inputs[1:]),
                     {**attrs, "epsilon": eps}, namer, product.outputs[0], total)
            graph.remove(product, safe=True)
            counts["norm"] += 1  # the norm is now unused: removed below
    if any(counts.values()):
        RemoveUnusedNodesPass()(model)
        model.opset_imports.setdefault(DOMAIN, 1)
    return PassResult(counts)


__all__ = ["DOMAIN", "OrtGemvParams", "ort_gemv"]
