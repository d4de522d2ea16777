"""W4A16: symmetric int4 weights in blocks along K, dequantized by DequantizeLinear-21 (`block_size`).

    W_q int4 [K, N] ─ DequantizeLinear(scale [ceil(K/B), N], axis=0, block_size=B) ─ MatMul(X, ·)

This is TensorRT's INT4 weight-only form; ORT runs it as is (and fuses it into MatMulNBits, whose
accuracy level `lower_ort` then sets explicitly). Round-to-nearest; AWQ is the `awq` pass before it;
GPTQ (gptq.py) writes the same nodes, also in an asymmetric form (uint4 with zero points).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.quant import qmath
from enginesmith.passes.machinery.edit import Namer, add_initializer, add_node
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.passes.analysis.linears import Linear
from enginesmith.passes.quant.w8a8 import chosen_or_fail

BLOCK_SIZES = (16, 32, 64, 128, 256)
MIN_OPSET = 21


def check_block_size(block_size: int, what: str) -> None:
    if block_size not in BLOCK_SIZES:
        raise UserError(f"{what}: block_size={block_size} is not supported",
                        f"use one of {', '.join(map(str, BLOCK_SIZES))} (128 is the default)")


@dataclass(frozen=True)
class W4A16Params:
    block_size: int = 128
    include_lm_head: bool = False

    def __post_init__(self):
        check_block_size(self.block_size, "quantize_w4a16")


def replace_with_int4(graph: ir.Graph, namer: Namer, lin: Linear, q: np.ndarray, scale: np.ndarray,
                      zero_point: np.ndarray | None, block_size: int) -> None:
    """Make `lin` read DequantizeLinear(q, scale[, zero_point]) instead of its float weight.

    q [K, N]: int4 values in [-8, 7] (symmetric, no zero point), or uint4 values in [0, 15] with
    zero_point [nb, N] in [0, 15] (asymmetric: ORT runs it, TensorRT wants zero points 0)."""
    old = lin.weight
    dtype = old.const_value.dtype
    zp = zero_point
    if zp is not None:                                           # uint4 codes and zero points
        q, zp = q.astype(np.uint8), zp.astype(np.uint8)
    if lin.k_axis == 1:                                          # stored [N, K]: blocks on axis 1
        q, scale, zp = q.T, scale.T, (None if zp is None else zp.T)
    kind = ir.DataType.INT4 if zp is None else ir.DataType.UINT4
    wq = add_initializer(graph, namer, f"{old.name}_int4", np.ascontiguousarray(q), kind)
    ws = add_initializer(graph, namer, f"{old.name}_scale",
                         np.ascontiguousarray(scale.astype(ir.DataType(dtype).numpy())))
    inputs = [wq, ws]
    if zp is not None:
        inputs.append(add_initializer(graph, namer, f"{old.name}_zero", np.ascontiguousarray(zp), ir.DataType.UINT4))
    out = add_node(graph, namer, "DequantizeLinear", inputs, {"axis": lin.k_axis, "block_size": block_size},
                   dtype=dtype, shape=ir.Shape(q.shape), before=lin.reader, base=f"{old.name}_dq")
    lin.reader.replace_input_with(lin.w_index, out)


@register("quantize_w4a16", W4A16Params, exact=False)
def quantize_w4a16(model: ir.Model, params: W4A16Params, ctx: PassContext) -> PassResult:
    """Int4 weights, blocks of `block_size` along K, scales in the activation dtype."""
    opset = model.opset_imports.get("", 0)
    if opset < MIN_OPSET:
        raise UserError(f"quantize_w4a16 needs opset >= {MIN_OPSET} (blocked DequantizeLinear); "
                        f"the graph has {opset}", f"export with --opset {MIN_OPSET} or newer")
    chosen, skipped = chosen_or_fail(model, params.include_lm_head, "quantize_w4a16")
    graph, namer, bs = model.graph, Namer(model.graph), params.block_size
    int4_params = 0
    for lin in chosen:
        int4_params += lin.k * lin.n
        q, scale = qmath.int4_blocks(lin.weight_kn(), bs)        # [K, N], [nb, N]
        replace_with_int4(graph, namer, lin, q, scale, None, bs)
    counts = {"linears": len(chosen), "skipped": len(skipped), "int4_params": int4_params}
    return PassResult(counts, skipped)
