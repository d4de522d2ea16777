"""W8A8: symmetric int8 Q/DQ on both inputs of every linear, as TensorRT's explicit quantization wants.

    X ─ QuantizeLinear(s_x, 0) ─ DequantizeLinear(s_x, 0) ─┐        s_x: per tensor, static
                                                            MatMul   (max |X| on calibration / 127)
    W_q int8 ─ DequantizeLinear(s_w[N], 0, axis=N) ─────────┘        s_w: per output channel

A dedicated Q/DQ pair per linear input, with its own (equal-valued) scale constants, also where
linears read the same tensor (q/k/v): ORT fuses Q/DQ+MatMul into int8 kernels
(MatMulIntegerToFloat) only for a pair with a single consumer, and would merge pairs that share
their constants back into one; TensorRT takes either form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer, add_initializer, add_node, qdq
from enginesmith.passes.analysis.linears import Linear, find_linears, select
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class W8A8Params:
    include_lm_head: bool = False


def chosen_or_fail(model: ir.Model, include_lm_head: bool, what: str) -> tuple[list[Linear], list]:
    """The linears to quantize, or a UserError when the graph has none (nothing would change)."""
    linears, rejected = find_linears(model)
    chosen, skipped = select(linears, include_lm_head)
    if not chosen:
        reasons = "; ".join(f"{r.node}: {r.reason}" for r in (skipped + rejected)[:3]) or "no MatMul/Gemm"
        raise UserError(f"{what}: the graph has no quantizable linear layers ({reasons})",
                        "quantize a graph exported from a causal LM, before any other quantization")
    return chosen, skipped + rejected


def weight_dq(graph: ir.Graph, namer: Namer, lin: Linear, q_kn: np.ndarray, scale: np.ndarray) -> None:
    """Replace the linear's weight by DequantizeLinear(int8 weight, per-N scale), same layout."""
    n_axis = 1 - lin.k_axis
    old = lin.weight
    stored = q_kn if lin.k_axis == 0 else q_kn.T
    dtype = old.const_value.dtype
    wq = add_initializer(graph, namer, f"{old.name}_int8", np.ascontiguousarray(stored))
    ws = add_initializer(graph, namer, f"{old.name}_scale", scale.astype(ir.DataType(dtype).numpy()))
    zp = add_initializer(graph, namer, f"{old.name}_zero", np.zeros(scale.shape, np.int8))
    out = add_node(graph, namer, "DequantizeLinear", [wq, ws, zp], {"axis": n_axis}, dtype=dtype,
                   shape=ir.Shape(stored.shape), before=lin.reader, base=f"{old.name}_dq")
    lin.reader.replace_input_with(lin.w_index, out)


@register("quantize_w8a8", W8A8Params, exact=False, calibrated=True)
def quantize_w8a8(model: ir.Model, params: W8A8Params, ctx: PassContext) -> PassResult:
    """Int8 weights (per output channel) and int8 activations (per tensor, static) on every linear."""
    chosen, skipped = chosen_or_fail(model, params.include_lm_head, "quantize_w8a8")
    stats = ctx.stats(sorted({lin.x.name for lin in chosen}))
    graph, namer = model.graph, Namer(model.graph)
    seen: set[int] = set()
    details = []
    for lin in chosen:
        x, tensor_max = lin.x, stats[lin.x.name].tensor_max
        if id(x) not in seen:
            seen.add(id(x))
            details.append({"activation": x.name, "max_abs": round(tensor_max, 4)})
        scale = add_initializer(graph, namer, f"{x.name}_scale",
                                np.array(qmath.act_scale(tensor_max), dtype=x.type.dtype.numpy()))
        zp = add_initializer(graph, namer, f"{x.name}_zero", np.array(0, np.int8))
        lin.node.replace_input_with(0, qdq(graph, namer, lin.x, scale, zp, before=lin.node))
        q, scale = qmath.int8_per_channel(lin.weight_kn())
        weight_dq(graph, namer, lin, q, scale)
    counts = {"linears": len(chosen), "activations": len(seen), "skipped": len(skipped)}
    return PassResult(counts, skipped, details)
