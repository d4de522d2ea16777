"""ORT lowering of an int8 embedding table shared with a tied lm_head (quantize_embedding's output).

    E int8 [V, H] ─ DQ(s, axis 0) ─ Transpose ─ MatMul(x, ·)    =>  MatMulNBits(x, B, s', bits=8)
    E int8 ─ Gather(ids) ─ Cast ─▶                              =>  B ─ Gather(ids) ─ Reshape(.., H)
                                                                       ─ Cast ─ Sub(128) ─▶
    B = E + 128 as uint8 [V, H / bs, bs]   (MatMulNBits' default 8-bit zero point is 128)
    s' = s repeated per block [V · H / bs]

One uint8 table serves both readers, so the file keeps one copy; ORT no longer dequantizes the
whole table on every step for the lm_head. Called by `lower_ort`; exact (integers are shifted, not
rounded), and MatMulNBits computes in the accuracy level the pass is given.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, add_initializer, add_node
from enginesmith.passes.machinery.match import Match, Rejection, Rule


def block_for(k: int) -> int | None:
    """The largest power-of-two block (16..128) that divides K, or None."""
    return next((b for b in (128, 64, 32, 16) if k % b == 0), None)


class TiedInt8Head(Rule):
    name = "MatMul(x, Transpose(DQ8(E)))"

    def pattern(self, op, x, q, scale):
        w = op.DequantizeLinear(q, scale, _allow_other_inputs=True, _allow_other_attributes=True)
        return op.MatMul(x, op.Transpose(w, _allow_other_attributes=True))

    def check(self, m: Match) -> str | None:
        q, scale = match.constant(m["q"]), match.constant(m["scale"])
        if q is None or q.dtype != ir.DataType.INT8 or len(q.shape) != 2:
            return "weight is not a constant int8 matrix"
        dq = next(n for n in m.nodes if n.op_type == "DequantizeLinear")
        transpose = next(n for n in m.nodes if n.op_type == "Transpose")
        if scale is None or tuple(scale.shape) != (q.shape[0],) or match.attr(dq, "axis", 1) != 0:
            return "not one scale per row"
        if len(dq.inputs) > 2 and dq.inputs[2] is not None and \
                (match.constant(dq.inputs[2]) is None or match.constant(dq.inputs[2]).numpy().any()):
            return "has a non-zero zero point"
        if list(match.attr(transpose, "perm", [1, 0])) != [1, 0]:
            return "transpose is not (1, 0)"
        if block_for(int(q.shape[1])) is None:
            return f"hidden size {q.shape[1]} is not a multiple of 16"
        return match.private_interior(m)


class Int8RowGather(Rule):
    name = "Cast(Gather(E int8, ids))"

    def pattern(self, op, q, ids):
        return op.Cast(op.Gather(q, ids, _allow_other_attributes=True), _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        tensor = match.constant(m["q"])
        if tensor is None or tensor.dtype != ir.DataType.INT8:
            return "not a gather from a constant int8 table"
        if match.attr(next(n for n in m.nodes if n.op_type == "Gather"), "axis", 0) != 0:
            return "gathers along an axis other than 0"
        return match.private_interior(m)


def _mnb(x: ir.Value, b: ir.Value, scales: ir.Value, k: int, n: int, block: int, level: int,
         name: str) -> ir.Node:
    attrs = [ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", 8),
             ir.AttrInt64("block_size", block), ir.AttrInt64("accuracy_level", level)]
    return ir.Node(MS_DOMAIN, "MatMulNBits", [x, b, scales], attrs, num_outputs=1, name=name)


def lower_tied_int8(model: ir.Model, accuracy_level: int) -> tuple[dict, list[Rejection]]:
    """Lower every tied int8 lm_head and the gathers of the same table; returns counts, rejections."""
    graph, namer = model.graph, Namer(model.graph)
    heads, rejected = match.find(model, TiedInt8Head())
    shared: dict[int, ir.Value] = {}  # id(int8 table) -> its uint8 MatMulNBits table
    for m in heads:
        q = m["q"].const_value.numpy()
        v, h = q.shape
        block = block_for(h)
        b = add_initializer(graph, namer, f"{m['q'].name}_u8",
                            (q.astype(np.int16) + 128).astype(np.uint8).reshape(v, h // block, block))
        s = add_initializer(graph, namer, f"{m['q'].name}_u8_scales",
                            np.repeat(m["scale"].const_value.numpy(), h // block))
        node = _mnb(m["x"], b, s, h, v, block, accuracy_level, f"{m.root.name}_nbits8")
        old = m.root.outputs[0]
        node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type = old.name, old.shape, old.type
        ir.convenience.replace_nodes_and_values(graph, m.root, list(m.nodes), [node], [old], [node.outputs[0]])
        shared[id(m["q"])] = b
    gathers, gather_rejects = match.find(model, Int8RowGather())
    rewired = 0
    for m in gathers:
        b = shared.get(id(m["q"]))
        if b is None:
            continue
        cast, out = m.root, m.root.outputs[0]
        h = int(b.shape[1]) * int(b.shape[2])
        rows = add_node(graph, namer, "Gather", [b, m["ids"]], {"axis": 0}, dtype=ir.DataType.UINT8,
                        before=cast, base=f"{b.name}_rows")
        shape = add_node(graph, namer, "Shape", [m["ids"]], dtype=ir.DataType.INT64, before=cast)
        hidden = add_initializer(graph, namer, f"{b.name}_hidden", np.array([h], np.int64))
        target = add_node(graph, namer, "Concat", [shape, hidden], {"axis": 0}, dtype=ir.DataType.INT64,
                          before=cast)
        flat = add_node(graph, namer, "Reshape", [rows, target], like=out, dtype=ir.DataType.UINT8,
                        before=cast, base=f"{b.name}_rows_flat")
        as_float = add_node(graph, namer, "Cast", [flat], {"to": int(out.type.dtype)}, like=out, before=cast)
        zero = add_initializer(graph, namer, f"{b.name}_zero_point",
                               np.array(128, dtype=out.type.dtype.numpy()))
        centered = add_node(graph, namer, "Sub", [as_float, zero], like=out, before=cast)
        ir.convenience.replace_all_uses_with(out, centered)
        graph.remove(cast, safe=True)
        graph.remove(next(n for n in m.nodes if n.op_type == "Gather"), safe=True)
        rewired += 1
    counts = {"matmulnbits_8bit": len(heads), "gathers_shared": rewired}
    return counts, rejected + [r for r in gather_rejects if "int8" not in r.reason]
