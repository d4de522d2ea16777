"""Int8 token embedding (weight-only, per row), shared with a tied lm_head. Off unless asked for.

    E int8 [V, H] ─ Gather(ids) ─ Cast(float) ─┐
    s [V] ──────── Gather(ids) ─ Unsqueeze(-1) ─┴ Mul ─▶ embedding          (rows gathered first:
                                                                             nothing dequantizes
    E int8 ─ DequantizeLinear(s, axis 0) ─ Transpose ─ MatMul ─▶ logits      the whole table)

The table is the largest tensor of a small model (SmolLM2: 28 M of 135 M parameters); keeping it in
fp16 caps what weight quantization can save, so size targets need this flag. Other readers of the
table (a tied lm_head) read the same int8 initializer through a per-row DequantizeLinear: one copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.machinery import match
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer, add_initializer, add_node
from enginesmith.passes.analysis.linears import FLOAT_TYPES
from enginesmith.passes.machinery.match import Match, Rejection, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class EmbeddingParams:
    tied_lm_head: bool = True     # let a tied lm_head read the int8 table too (else skip tied tables)


class EmbeddingRule(Rule):
    name = "Gather(E, ids)"

    def pattern(self, op, table, ids):
        return op.Gather(table, ids, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        tensor = match.constant(m["table"])
        if tensor is None or len(tensor.shape) != 2 or tensor.dtype not in FLOAT_TYPES:
            return "not a gather from a constant float table"
        if match.attr(m.root, "axis", 0) != 0:
            return "gathers along an axis other than 0"
        if tensor.shape[0] < 256:
            return f"table of {tensor.shape[0]} rows is too small to matter"
        return None


@register("quantize_embedding", EmbeddingParams, exact=False)
def quantize_embedding(model: ir.Model, params: EmbeddingParams, ctx: PassContext) -> PassResult:
    """Int8 per-row embedding tables (gather, then dequantize the gathered rows)."""
    found, rejected = match.find(model, EmbeddingRule())
    graph, namer = model.graph, Namer(model.graph)
    done, shared = 0, 0
    for m in found:
        table = m["table"]
        others = [u.node for u in table.uses() if u.node is not m.root]
        if others and not params.tied_lm_head:
            rejected.append(Rejection("embedding", m.root.name, "table is shared with another "
                                      "reader (tied lm_head) and tied_lm_head=false", m.root))
            continue
        dtype = table.const_value.dtype
        fdtype = ir.DataType(dtype).numpy()
        q_t, scale = qmath.int8_per_channel(table.const_value.numpy().astype(np.float32).T)  # per row
        q = add_initializer(graph, namer, f"{table.name}_int8", np.ascontiguousarray(q_t.T))
        s = add_initializer(graph, namer, f"{table.name}_scale", scale.astype(fdtype))
        out = m.root.outputs[0]
        ids = m["ids"]
        rows = add_node(graph, namer, "Gather", [q, ids], {"axis": 0}, like=out, dtype=ir.DataType.INT8,
                        before=m.root, base=f"{table.name}_rows")
        row_s = add_node(graph, namer, "Gather", [s, ids], {"axis": 0}, like=ids, dtype=dtype,
                         before=m.root, base=f"{table.name}_row_scale")
        axes = add_initializer(graph, namer, f"{table.name}_axes", np.array([-1], np.int64))
        row_s = add_node(graph, namer, "Unsqueeze", [row_s, axes], dtype=dtype, before=m.root,
                         base=f"{table.name}_row_scale_u")
        rows_f = add_node(graph, namer, "Cast", [rows], {"to": int(dtype)}, like=out, before=m.root,
                          base=f"{table.name}_rows_f")
        emb = add_node(graph, namer, "Mul", [rows_f, row_s], like=out, before=m.root,
                       base=f"{table.name}_dequant")
        ir.convenience.replace_all_uses_with(out, emb)
        graph.remove(m.root, safe=True)
        for node in others:  # the tied lm_head: dequantize the same int8 table per row
            zp = add_initializer(graph, namer, f"{table.name}_zero", np.zeros(scale.shape, np.int8))
            full = add_node(graph, namer, "DequantizeLinear", [q, s, zp], {"axis": 0}, dtype=dtype,
                            shape=ir.Shape(q_t.T.shape), before=node, base=f"{table.name}_dq")
            for i, inp in enumerate(node.inputs):
                if inp is table:
                    node.replace_input_with(i, full)
            shared += 1
        done += 1
    if not found:
        raise UserError("quantize_embedding: the graph has no embedding gather from a float table",
                        "drop quantize_embedding, or run it on an unquantized exported graph")
    return PassResult({"tables": done, "shared_readers": shared}, rejected)
