"""ort_attention: com.microsoft.GroupQueryAttention -> enginesmith's GroupQueryAttention ORT custom op
(plugins/ort_ops/attention.h, domain com.enginesmith): one kernel per layer and step where ORT CUDA
runs five (rotary + cache append, sequence lengths, a fill, the attention, its split reduction).

    GroupQueryAttention(qkv, -, -, past_k, past_v, seqlens_k, total_sequence_length, cos, sin;
                        do_rotary=1, rotary_interleaved=0)            (com.microsoft)
  =>
    GroupQueryAttention(qkv, past_k, past_v, seqlens_k, total_sequence_length, cos, sin)
                                                                      (com.enginesmith)

Same inputs (less the unused key/value), outputs and semantics: packed QKV, half-split rotary, causal
attention over past + new tokens, the new K/V written into the present buffer. Applies to fp16, head
size 64 or 128, at most 16 query heads per KV head, without softcap, local window or smooth softmax.
Not exact: sums in another order (fp32), checked with a tolerance. The graph then needs the library at
run time (plugins/ort_ops.py registers it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, replace_value, to_attrs
from enginesmith.passes.lower.ort_gemv import DOMAIN, MS_DOMAIN
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

HEAD_SIZES = (64, 128)
MAX_GROUP = 16  # query heads per KV head a block holds


@dataclass(frozen=True)
class OrtAttentionParams:
    pass


def _inputs(node: ir.Node) -> tuple[list[ir.Value], dict] | None:
    """(inputs, attributes) of the custom op that replaces `node`, or None if it does not apply."""
    if node.domain != MS_DOMAIN or node.op_type != "GroupQueryAttention":
        return None
    ins = list(node.inputs) + [None] * (9 - len(node.inputs))
    if len(node.inputs) > 9 or ins[1] is not None or ins[2] is not None or any(ins[i] is None for i in (0, 3, 4, 5, 6, 7, 8)):
        return None
    if (match.attr(node, "do_rotary", 0), match.attr(node, "rotary_interleaved", 0)) != (1, 0) or \
            match.attr(node, "local_window_size", -1) != -1 or match.attr(node, "softcap", 0.0) or \
            match.attr(node, "smooth_softmax", 0) or match.attr(node, "qk_output", 0):
        return None
    qkv, cos = ins[0], match.constant(ins[7])
    if qkv.type is None or qkv.dtype != ir.DataType.FLOAT16 or cos is None or len(cos.shape) != 2:
        return None
    heads, kv_heads, head_size = match.attr(node, "num_heads"), match.attr(node, "kv_num_heads"), 2 * cos.shape[1]
    if not heads or not kv_heads or heads % kv_heads or heads // kv_heads > MAX_GROUP or head_size not in HEAD_SIZES:
        return None
    scale = match.attr(node, "scale", 0.0) or 1.0 / math.sqrt(head_size)
    return [ins[0], ins[3], ins[4], ins[5], ins[6], ins[7], ins[8]], \
        {"num_heads": heads, "kv_num_heads": kv_heads, "scale": float(scale)}


@register("ort_attention", OrtAttentionParams, exact=False)
def ort_attention(model: ir.Model, params: OrtAttentionParams | None = None,
                  ctx: PassContext | None = None) -> PassResult:
    """com.microsoft.GroupQueryAttention (rotary, packed QKV) -> com.enginesmith.GroupQueryAttention."""
    graph = model.graph
    namer = Namer(graph)
    count = 0
    for node in list(graph):
        found = _inputs(node)
        if found is None:
            continue
        inputs, attrs = found
        new = ir.Node(DOMAIN, "GroupQueryAttention", inputs, to_attrs(attrs), num_outputs=3,
                      name=namer(f"{node.name or 'gqa'}_es"))
        graph.insert_before(node, new)
        for old, value in zip(node.outputs, new.outputs):
            replace_value(graph, old, value, namer(f"{old.name}_es"))
        graph.remove(node, safe=True)
        count += 1
    if count:
        model.opset_imports.setdefault(DOMAIN, 1)
    return PassResult({"attention": count})


__all__ = ["OrtAttentionParams", "ort_attention"]
