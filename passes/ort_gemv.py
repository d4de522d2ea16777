"""ort_gemv: decode matrix products -> enginesmith's ORT custom ops (plugins/ort_ops, domain com.enginesmith).

    x ─ FusedMatMul(W [N, K], transB=1) ─ y                  x ─ Gemv(W) ─ y
    x ─ MatMulNBits(B, scales; bits=4, symmetric) ─ y         x ─ GemvQ4(B, scales) ─ y
    x ─ gate ─ Sigmoid ─ Mul ─┐                              x ─ SwiGluGemv(Wg, Wu) ─ y
    x ─ up ───────────────────Mul ─ y                         (SwiGluGemvQ4 for int4 weights)

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

from enginesmith.passes import match
from enginesmith.passes.edit import Namer, replace_value
from enginesmith.passes.registry import PassContext, PassResult, register

DOMAIN = "com.enginesmith"
MS_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class OrtGemvParams:
    swiglu: bool = True  # fuse gate/up/SiLU/Mul into one op


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
             out_of: ir.Value) -> ir.Node:
    node = ir.Node(DOMAIN, op, inputs, [ir.AttrInt64(k, int(v)) for k, v in attrs.items()], num_outputs=1,
                   name=namer(f"{old.name or op}_{op.lower()}"))
    graph.insert_before(old, node)
    replace_value(graph, out_of, node.outputs[0], namer(f"{out_of.name}_{op.lower()}"))
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


@register("ort_gemv", OrtGemvParams, exact=False)
def ort_gemv(model: ir.Model, params: OrtGemvParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """fp16 FusedMatMul(transB) and int4 MatMulNBits -> com.enginesmith Gemv ops; SwiGLU MLPs fused."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    params = params or OrtGemvParams()
    graph = model.graph
    namer = Namer(graph)
    counts = {"gemv": 0, "gemv_q4": 0, "swiglu": 0}
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
    if any(counts.values()):
        RemoveUnusedNodesPass()(model)
        model.opset_imports.setdefault(DOMAIN, 1)
    return PassResult(counts)


__all__ = ["DOMAIN", "OrtGemvParams", "ort_gemv"]
