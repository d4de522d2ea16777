"""ort_attention: com.microsoft.GroupQueryAttention -> enginesmith's GroupQueryAttention ORT custom op
(plugins/ort_ops/attention.h, domain com.enginesmith): one kernel per layer and step where ORT CUDA
runs five (rotary + cache append, sequence lengths, a fill, the attention, its split reduction).

    GroupQueryAttention(qkv, -, -, past_k, past_v, seqlens_k, total_sequence_length, cos, sin;
                        do_rotary=1, rotary_interleaved=0[, softcap][, local_window_size])  (com.microsoft)
  =>
    GroupQueryAttention(qkv, past_k, past_v, seqlens_k, total_sequence_length, cos, sin
                        [; softcap][; local_window_size])                                 (com.enginesmith)

Same inputs (less the unused key/value), outputs and semantics: packed QKV, half-split rotary, causal
attention over past + new tokens, the new K/V written into the present buffer; Gemma 2's soft-capping
and sliding windows (Gemma 2/3, Mistral) carried over as the same attributes. Applies to fp16, head
size 64, 128 or 256, at most 16 query heads per KV head (8 at head size 256), without smooth softmax
or qk output; any other GroupQueryAttention is left to ORT and reported with the reason
(PassResult.skipped).
Not exact: sums in another order (fp32), checked with a tolerance. The graph then needs the library at
run time (plugins/ort_ops.py registers it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.core.io_names import MS_DOMAIN, ORT_OPS_DOMAIN as DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import Namer, replace_value, to_attrs
from enginesmith.passes.machinery.match import Match, Rule
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

HEAD_SIZES = (64, 128, 256)
MAX_GROUP = {64: 16, 128: 16, 256: 8}  # query heads per KV head a block holds, by head size
# The ORT op's inputs, in order; the custom op takes all but key and value.
GQA_INPUTS = ("qkv", "key", "value", "past_k", "past_v", "seqlens_k", "total_len", "cos", "sin")
KEPT = ("qkv", "past_k", "past_v", "seqlens_k", "total_len", "cos", "sin")
# Attributes whose non-default values the kernel does not implement.
UNSUPPORTED = {"smooth_softmax": 0, "qk_output": 0}
# Attributes the kernel takes as they are, with their "off" values (left off the new node).
CARRIED = {"softcap": 0.0, "local_window_size": -1}


class EsGqaRule(Rule):
    """Root: a com.enginesmith.GroupQueryAttention with the KEPT inputs (ort_attention's output). The
    passes that rewrite it further (paged_gqa, quantize_kv) check its inputs by name in `check_inputs`."""

    def pattern(self, op, qkv):
        return op.GroupQueryAttention(qkv, _domain=DOMAIN, _allow_other_inputs=True, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        node = m.root
        if len(node.inputs) != len(KEPT):
            return f"{len(node.inputs)} inputs, not the {len(KEPT)} of ort_attention's op"
        return self.check_inputs(node, dict(zip(KEPT, node.inputs)))

    def check_inputs(self, node: ir.Node, ins: dict[str, ir.Value]) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class OrtAttentionParams:
    pass


class PackedRotaryGQA(Rule):
    """Root: a com.microsoft.GroupQueryAttention on packed QKV with half-split rotary and a KV cache."""

    name = "gqa->es_gqa"

    def pattern(self, op, qkv):
        return op.GroupQueryAttention(qkv, _domain=MS_DOMAIN, _allow_other_inputs=True,
                                      _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        node = m.root
        ins = dict(zip(GQA_INPUTS, list(node.inputs) + [None] * (len(GQA_INPUTS) - len(node.inputs))))
        if len(node.inputs) > len(GQA_INPUTS):
            return f"{len(node.inputs)} inputs (position ids, attention bias, ...) the kernel does not take"
        if ins["key"] is not None or ins["value"] is not None:
            return "Q, K and V are separate inputs (the kernel reads packed QKV)"
        missing = [k for k in KEPT if ins[k] is None]
        if missing:
            return f"has no {', '.join(missing)}"
        if (match.attr(node, "do_rotary", 0), match.attr(node, "rotary_interleaved", 0)) != (1, 0):
            return "no fused rotary, or interleaved rotary (the kernel applies half-split rotary)"
        for name, default in UNSUPPORTED.items():
            if match.attr(node, name, default) != default:
                return f"{name}={match.attr(node, name)} is not supported"
        qkv, cos = ins["qkv"], match.constant(ins["cos"])
        if qkv.type is None or qkv.dtype != ir.DataType.FLOAT16:
            return "QKV is not fp16"
        if cos is None or len(cos.shape) != 2:
            return "the cos cache is not a constant [positions, D / 2] table"
        heads, kv_heads = match.attr(node, "num_heads"), match.attr(node, "kv_num_heads")
        if not heads or not kv_heads or heads % kv_heads:
            return f"{heads} query heads are not a multiple of {kv_heads} KV heads"
        head_size = 2 * cos.shape[1]
        if head_size not in HEAD_SIZES:
            return f"head size {head_size} is not one of {HEAD_SIZES}"
        if heads // kv_heads > MAX_GROUP[head_size]:
            return f"{heads // kv_heads} query heads per KV head, over {MAX_GROUP[head_size]} at head size {head_size}"
        softcap, window = match.attr(node, "softcap", 0.0), match.attr(node, "local_window_size", -1)
        if not softcap >= 0.0:
            return f"softcap={softcap} is negative"
        if window == 0 or window < -1:
            return f"local_window_size={window} is neither positive nor -1 (off)"
        return None


def _rewrite(graph: ir.Graph, namer: Namer, m: Match) -> None:
    node = m.root
    ins = dict(zip(GQA_INPUTS, node.inputs))
    head_size = 2 * match.constant(ins["cos"]).shape[1]
    scale = match.attr(node, "scale", 0.0) or 1.0 / math.sqrt(head_size)
    attrs = {"num_heads": match.attr(node, "num_heads"), "kv_num_heads": match.attr(node, "kv_num_heads"),
             "scale": float(scale)}
    attrs.update({name: match.attr(node, name) for name, off in CARRIED.items()
                  if match.attr(node, name, off) != off})
    new = ir.Node(DOMAIN, "GroupQueryAttention", [ins[k] for k in KEPT], to_attrs(attrs), num_outputs=3,
                  name=namer(f"{node.name or 'gqa'}_es"))
    graph.insert_before(node, new)
    for old, value in zip(node.outputs, new.outputs):
        replace_value(graph, old, value, namer(f"{old.name}_es"))
    graph.remove(node, safe=True)


@register("ort_attention", OrtAttentionParams, exact=False)
def ort_attention(model: ir.Model, params: OrtAttentionParams | None = None,
                  ctx: PassContext | None = None) -> PassResult:
    """com.microsoft.GroupQueryAttention (rotary, packed QKV) -> com.enginesmith.GroupQueryAttention."""
    found, rejected = match.find(model, PackedRotaryGQA())
    namer = Namer(model.graph)
    for m in found:  # collect the matches first, then change the graph
        _rewrite(model.graph, namer, m)
    if found:
        model.opset_imports.setdefault(DOMAIN, 1)
    return PassResult({"attention": len(found)}, rejected)


__all__ = ["OrtAttentionParams", "PackedRotaryGQA", "ort_attention"]
