"""ORT lowering: blocked int4 DequantizeLinear + MatMul/Gemm -> com.microsoft.MatMulNBits.

    W_q int4 [K, N] ─ DQ(scale [nb, N], axis 0, block B) ─┐
    X ─────────────────────────────────────────────────────┴ MatMul      =>   MatMulNBits(X, B_packed,
                                                                               scales, bias) K N bits=4
    B_packed uint8 [N, nb, B/2]: q + 8 (ORT's default zero point for 4 bits), low nibble first,
    K padded to nb * B with the zero point; scales [N * nb]. Asymmetric (uint4 codes with zero points
    [nb, N], from gptq): the codes as they are, and zero_points uint8 [N, ceil(nb / 2)].

ORT would fuse the same pattern on its own, but with accuracy_level 4 (int8 activations, ~1 %
error) unless a session option says otherwise; lowering here writes the accuracy level into the
graph: 0 (default) and 1 compute in fp32, 2 fp16, 3 bf16, 4 int8. At 0/1 the pass is exact to
fp32 rounding and is checked like one.

An int8 embedding table shared with a tied lm_head (quantize_embedding) becomes an 8-bit
MatMulNBits for the lm_head, still sharing one table with the gather (lower_ort_int8.py).
Measured on a 2-core AVX2 CPU (no VNNI): MatMulNBits at accuracy level 0 is slower than an fp32
MatMul for one token when the weights fit in cache, and the 8-bit kernel at level 0 is very slow;
level 4 is the fast CPU path (benchmarks/quant/results).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, add_initializer
from enginesmith.passes.lower.lower_ort_int8 import lower_tied_int8
from enginesmith.passes.machinery.match import Match, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register


@dataclass(frozen=True)
class LowerOrtParams:
    accuracy_level: int = 0

    def __post_init__(self):
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise UserError(f"lower_ort accuracy_level={self.accuracy_level} is not 0-4",
                            "use 0 (fp32, default), 1 (fp32), 2 (fp16), 3 (bf16) or 4 (int8)")


class BlockedInt4Linear(Rule):
    def __init__(self, gemm: bool):
        self.gemm = gemm
        self.name = "Gemm(x, DQ4(W))" if gemm else "MatMul(x, DQ4(W))"

    def pattern(self, op, x, q, scale):
        w = op.DequantizeLinear(q, scale, _allow_other_inputs=True, _allow_other_attributes=True)
        if self.gemm:
            return op.Gemm(x, w, _allow_other_inputs=True, _allow_other_attributes=True)
        return op.MatMul(x, w)

    def check(self, m: Match) -> str | None:
        dq = next(n for n in m.nodes if n.op_type == "DequantizeLinear")
        q, scale = match.constant(m["q"]), match.constant(m["scale"])
        if q is None or q.dtype not in (ir.DataType.INT4, ir.DataType.UINT4) or len(q.shape) != 2:
            return "weight is not constant blocked int4 (other Q/DQ stays for ORT to run as is)"
        if scale is None:
            return "scale is not a constant"
        zp = dq.inputs[2] if len(dq.inputs) > 2 else None
        if q.dtype == ir.DataType.INT4 and zp is not None:
            return "int4 with an explicit zero point"
        if q.dtype == ir.DataType.UINT4 and (zp is None or match.constant(zp) is None):
            return "uint4 without a constant zero point"
        block = match.attr(dq, "block_size", 0)
        if match.attr(dq, "axis", 1) != 0 or block < 16 or block & (block - 1):
            return f"blocks are not along K (axis 0) with a power-of-two size >= 16 (block {block})"
        if self.gemm and any(match.attr(m.root, name, default) != default for name, default in
                             (("transA", 0), ("transB", 0), ("alpha", 1.0), ("beta", 1.0))):
            return "Gemm with transposes or alpha/beta"
        return match.private_interior(m)


RULES = [BlockedInt4Linear(False), BlockedInt4Linear(True)]


def pack_int4(q_kn: np.ndarray, block_size: int) -> np.ndarray:
    """int4 values [K, N] in [-8, 7] -> MatMulNBits' B uint8 [N, nb, block_size / 2]."""
    k, n = q_kn.shape
    nb = -(-k // block_size)
    u = np.full((nb * block_size, n), 8, dtype=np.uint8)
    u[:k] = (q_kn.astype(np.int16) + 8).astype(np.uint8)
    u = u.T.reshape(n, nb, block_size // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8)


def pack_uint4(q_kn: np.ndarray, zero: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """uint4 codes [K, N] and zero points [nb, N] -> MatMulNBits' B uint8 [N, nb, block_size / 2]
    (K padded with the last block's zero point) and zero_points uint8 [N, ceil(nb / 2)]."""
    k, n = q_kn.shape
    nb = -(-k // block_size)
    u = np.repeat(zero.astype(np.uint8), block_size, axis=0)
    u[:k] = q_kn.astype(np.uint8)
    u = u.T.reshape(n, nb, block_size // 2, 2)
    z = np.zeros((n, 2 * -(-nb // 2)), dtype=np.uint8)
    z[:, :nb] = zero.T
    return (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8), (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8)


def _lower(graph: ir.Graph, namer: Namer, m: Match, accuracy_level: int) -> None:
    dq = next(n for n in m.nodes if n.op_type == "DequantizeLinear")
    block = match.attr(dq, "block_size")
    scale = m["scale"].const_value.numpy()                   # [nb, N]
    base = m["q"].name.removesuffix("_int4")
    zp = None
    if m["q"].const_value.dtype == ir.DataType.UINT4:        # asymmetric: codes and zero points
        b, z = pack_uint4(m["q"].const_value.numpy(), dq.inputs[2].const_value.numpy(), block)
        zp = add_initializer(graph, namer, f"{base}_nbits_zero_points", z.reshape(-1))
    else:
        b = pack_int4(m["q"].const_value.numpy().astype(np.int8), block)
    k, n = m["q"].const_value.shape
    k, n = int(k), int(n)
    packed = add_initializer(graph, namer, f"{base}_nbits", b)
    scales = add_initializer(graph, namer, f"{base}_nbits_scales", np.ascontiguousarray(scale.T).reshape(-1))
    bias = m.root.inputs[2] if m.root.op_type == "Gemm" and len(m.root.inputs) > 2 else None
    inputs = [m["x"], packed, scales] + ([zp] if zp is not None else [])
    if bias is not None:
        inputs += [None] * (5 - len(inputs)) + [bias]
    attrs = [ir.AttrInt64("K", k), ir.AttrInt64("N", n), ir.AttrInt64("bits", 4),
             ir.AttrInt64("block_size", block), ir.AttrInt64("accuracy_level", accuracy_level)]
    node = ir.Node(MS_DOMAIN, "MatMulNBits", inputs, attrs, num_outputs=1, name=f"{m.root.name}_nbits")
    old = m.root.outputs[0]
    node.outputs[0].name, node.outputs[0].shape, node.outputs[0].type = old.name, old.shape, old.type
    ir.convenience.replace_nodes_and_values(graph, m.root, [dq, m.root], [node], [old], [node.outputs[0]])


@register("lower_ort", LowerOrtParams, exact=lambda p: p.accuracy_level in (0, 1))
def lower_ort(model: ir.Model, params: LowerOrtParams, ctx: PassContext) -> PassResult:
    """Blocked int4 DQ + MatMul/Gemm (and a tied int8 lm_head) -> com.microsoft.MatMulNBits with an
    explicit accuracy level."""
    found, rejected = match.find_all(model, RULES)
    namer = Namer(model.graph)
    for m in found:  # collect the matches first, then change the graph
        _lower(model.graph, namer, m, params.accuracy_level)
    counts8, rejected8 = lower_tied_int8(model, params.accuracy_level)
    if found or counts8["matmulnbits_8bit"]:
        model.opset_imports.setdefault(MS_DOMAIN, 1)
    counts = {"matmulnbits": len(found), **counts8, "not_lowered": len(rejected)}
    return PassResult(counts, rejected + rejected8)
