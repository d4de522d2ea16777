"""quantize_kv: enginesmith's GroupQueryAttention over dense fp16 KV buffers (ort_attention's output) ->
the same op over int8 or fp8 (e4m3) KV buffers with static channel scales, for the dense CUDA engine
(`build --for-cuda --custom-attention --kv-dtype int8|fp8`): half the KV bytes, so a decode step reads
half the cache and the same memory holds twice the rows or twice the positions.

Dimension legend: B rows, S new tokens, H query heads, Hkv key/value heads, D head size, C KV capacity.

Per layer:

    past_k, past_v [B,Hkv,C,D] fp16 ──┐                      ┌─ present_k, present_v fp16
    qkv, seqlens_k, total, cos, sin ──┴─ GroupQueryAttention ┴─ out
  =>
    past_k, past_v [B,Hkv,C,D] int8 | uint8 (fp8 e4m3 bytes) ─┐                      ┌─ present_k, present_v
    qkv, seqlens_k, total, cos, sin ──────────────────────────┼─ GroupQueryAttention ┤  (the same type)
    kv_scale [2,Hkv,D] float32 (an initializer) ──────────────┘   (com.enginesmith)  └─ out

The op writes the new K/V as codes and reads every key and value decoded (plugins/ort_ops/attention.h;
plugins/paged_attention/kv_quant.h holds the one definition of the codes). The scales are the paged
engine's: per (layer, KV head, channel), calibrated on the input graph by passes/analysis/kv_calibrate.py
(K's rotation-invariant pair-norm bound, V's absmax, over calibration windows), the same layout as
PagedGroupQueryAttention's kv_scale. The graph's kv_layout metadata (machinery/edit.KV_LAYOUT_KEY) records
kv_dtype, which the runtime reads off the buffers' type anyway.

Every attention layer must be enginesmith's op on shared buffers: a com.microsoft GroupQueryAttention
left by ort_attention (bf16, ...) is refused with its reason, since ONNX Runtime's own attention reads
fp16 KV only and the runtime allocates one buffer type for all layers.
Not checked by the pass manager (lossy): tests/runtime/test_dense_kv_quant.py compares the logits with the
fp16-KV engine's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import MS_DOMAIN
from enginesmith.passes.analysis import kv_calibrate
from enginesmith.passes.lower.lower_gqa import lowered_capacity
from enginesmith.passes.lower.ort_attention import EsGqaRule, PackedRotaryGQA
from enginesmith.passes.kv.ort_paged_gqa import ES_GQA_INPUTS, KV_DTYPES, kv_buffer_reason
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, Namer, add_initializer
from enginesmith.passes.machinery.match import Match
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

FIX = "build with --custom-attention (every layer enginesmith's attention op), or drop --kv-dtype"


@dataclass(frozen=True)
class QuantizeKvParams:
    kv_dtype: str = "int8"  # the KV buffers: int8 or fp8 (e4m3) codes with calibrated channel scales
    calib_windows: int = 8  # calibration windows the scales are taken over

    def __post_init__(self):
        if self.kv_dtype not in ("int8", "fp8"):
            raise UserError(f"quantize_kv kv_dtype={self.kv_dtype!r} is not a quantized KV format",
                            "use kv_dtype int8 or fp8 (fp16 buffers need no pass)")
        if self.calib_windows < 1:
            raise UserError(f"quantize_kv calib_windows={self.calib_windows!r} must be positive", "e.g. 8")


class DenseFp16GQA(EsGqaRule):
    """Root: a com.enginesmith.GroupQueryAttention on fp16 KV buffers that are graph inputs (no kv_scale)."""

    name = "es_gqa->es_gqa_kvq"

    def check_inputs(self, node: ir.Node, ins: dict[str, ir.Value]) -> str | None:
        for name in ("past_k", "past_v"):
            reason = kv_buffer_reason(node, ins[name])
            if reason:
                return reason
            if ins[name].dtype != ir.DataType.FLOAT16:
                return f"{ins[name].name} is not fp16"
        return None


def _refuse(model: ir.Model, found: list[Match], rejected) -> None:
    """Refuse a graph whose layers cannot all hold quantized KV, naming the first at fault and why."""
    leftover = [n for n in model.graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if leftover:
        _, reasons = match.find(model, PackedRotaryGQA())
        why = next((r.reason for r in reasons if r.root is leftover[0]), "ort_attention was not run")
        raise UserError(f"quantize_kv: attention {leftover[0].name!r} ({len(leftover)} layers) is ONNX Runtime's "
                        f"GroupQueryAttention ({why}), which reads fp16 KV only", FIX)
    if rejected:
        r = rejected[0]
        raise UserError(f"quantize_kv cannot quantize the KV of attention {r.node!r} ({len(rejected)} layers): "
                        f"{r.reason}", FIX)
    if not found:
        raise UserError("quantize_kv found no com.enginesmith.GroupQueryAttention",
                        "run lower_gqa and ort_attention first")


@register("quantize_kv", QuantizeKvParams, exact=False, calibrated=True)
def quantize_kv(model: ir.Model, params: QuantizeKvParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """com.enginesmith.GroupQueryAttention on fp16 KV buffers -> the same on int8 / fp8 codes with
    calibrated channel scales (see the module doc)."""
    params = params or QuantizeKvParams()
    capacity = lowered_capacity(model, "quantize_kv")
    found, rejected = match.find(model, DenseFp16GQA())
    _refuse(model, found, rejected)
    kv_scales = kv_calibrate.attention_scales("quantize_kv", [m.root for m in found], params.kv_dtype,
                                                params.calib_windows, ctx, capacity)  # before any change: calibrated on the input graph
    graph, element = model.graph, ir.TensorType(KV_DTYPES[params.kv_dtype])
    namer = Namer(graph)
    for m, kv_scale in zip(found, kv_scales):  # collect the matches first, then change the graph
        node = m.root
        node.resize_inputs(len(ES_GQA_INPUTS) + 1)  # + kv_scale (input 7)
        node.replace_input_with(len(ES_GQA_INPUTS), add_initializer(graph, namer, f"{node.name or 'gqa'}_kv_scale",
                                                                     kv_scale))
        for value in (node.inputs[1], node.inputs[2], node.outputs[1], node.outputs[2]):
            value.type = element
    layout = json.loads(model.metadata_props.get(KV_LAYOUT_KEY, "") or '{"type": "dense"}')
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps({**layout, "capacity": capacity, "kv_dtype": params.kv_dtype})
    return PassResult({"quantize_kv": len(found)})


__all__ = ["QuantizeKvParams", "DenseFp16GQA", "quantize_kv"]
