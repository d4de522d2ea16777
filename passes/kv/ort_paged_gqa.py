"""paged_gqa: enginesmith's GroupQueryAttention over one dense KV buffer per layer (ort_attention's
output) -> its paged twin com.enginesmith.PagedGroupQueryAttention (plugins/ort_ops) over page pools,
for in-flight batching: the rows of a step are independent requests whose K/V live in pages anywhere
in one pool per layer, so requests join and leave between steps without moving any cache.

Dimension legend: B rows of a step, S new tokens per row, H query heads, Hkv key/value heads, D head
size, C KV capacity (positions one row may hold, the rotary tables' rows), BS page size, NB pages in
the pool (the symbolic dim num_pages), MB = ceil(C / BS) pages in a row's block table.

Per layer, before:

    qkv [B,S,(H+2Hkv)D] ──────┐
    past_k, past_v [B,Hkv,C,D]┤
    seqlens_k [B] int32 ──────┼─ GroupQueryAttention ──────┬─ out [B,S,HD]
    total_sequence_length ────┤   (com.enginesmith)        ├─ present_k, present_v: past_k, past_v
    cos, sin [C, D/2] ────────┘                            └  (the shared buffers, written in place)
  =>
    qkv ──────────────────────┐
    past_k, past_v [NB,BS,Hkv,D]  (the pools)
    block_tables [B,MB] int32 ┼─ PagedGroupQueryAttention ─┬─ out [B,S,HD]
    context_lens [B] int32 ───┤   (com.enginesmith; same   ├─ present_k, present_v: the pools,
    slot_mapping [B,S] int32 ─┤    num_heads, kv_num_heads, └  written in place through the slots
    cos, sin [C, D/2] ────────┘    scale, softcap, local_window_size)

Interface after the pass (io_names; build.json kv_layout.io = PAGED_GQA_IO):

    inputs   input_ids [B, S] int64
             block_tables [B, MB] int32    page of each row's i-th block of BS positions
             context_lens [B] int32        tokens in row b's cache after this step; column s sits at
                                           position context_lens[b] - S + s (rotary and causal mask)
             slot_mapping [B, S] int32     page * BS + offset where column s's K/V goes; -1 = right
                                           padding, not written (context_lens still counts the width)
             past_key_values.{i}.key/value [num_pages, BS, Hkv, D]
    outputs  logits [B, S, V], present.{i}.key/value [num_pages, BS, Hkv, D] (the pools, bound in place)

seqlens_k and total_sequence_length leave the graph. The page size and capacity are recorded in the
graph's kv_layout metadata.

kv_dtype "int8" | "fp8" quantizes the pages (plugins/paged_attention/kv_quant.h): the pools become
int8 / uint8 (fp8 e4m3 bytes) [num_pages, BS, Hkv, D], half the bytes of fp16, and each layer's op
gets a ninth input, its static channel scales kv_scale [2, Hkv, D] float32 (an initializer),
calibrated on the input graph (passes/analysis/kv_calibrate.py: K's rotation-invariant pair-norm
bound, V's absmax, over calibration windows). The graph's kv_layout metadata records kv_dtype. Page sizes and the most columns per step (S) are the paged-attention
kernels' limits (plugins/limits.json: 16/32/64, S <= 16): the runtime feeds prompts in chunks. Soft-capping
(Gemma 2) and each layer's sliding window (local_window_size: Gemma 2/3's alternating layers, Mistral)
carry over as the same attributes; q/k norms (Qwen 3, Gemma 3) are nodes before the attention, which
the pass leaves as they are. Every attention layer must be enginesmith's op: a com.microsoft one that
ort_attention could not take (bf16, ...) is refused with its reason, since the paged CUDA engine has no
other paged attention; so is an enginesmith one the paged op cannot take (a head size outside
plugins/limits.json's). Not checked by the pass manager (it cannot feed the new interface):
tests/passes/test_paged_gqa.py and tests/models/test_paged_families.py compare the logits with the dense graph's.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.io_names import MS_DOMAIN, ORT_OPS_DOMAIN as DOMAIN, PAGED_GQA_IO
from enginesmith.passes.analysis import kv_calibrate
from enginesmith.passes.lower.lower_gqa import SEQLENS, TOTAL, lowered_capacity
from enginesmith.passes.lower.ort_attention import CARRIED, KEPT, EsGqaRule, PackedRotaryGQA
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, Namer, add_initializer, replace_value, to_attrs
from enginesmith.passes.machinery.match import Match
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.plugins.limits import limits as kernel_limits

POOL_DIM = "num_pages"
ES_GQA_INPUTS = KEPT  # com.enginesmith.GroupQueryAttention's inputs, in order
FIX = "build this model with a dense KV cache (--for-cuda without --kv paged)"
KV_DTYPES = {"fp16": ir.DataType.FLOAT16, "int8": ir.DataType.INT8, "fp8": ir.DataType.UINT8}  # pool element


@dataclass(frozen=True)
class PagedGqaParams:
    page_size: int = 16     # BS: tokens per KV page
    kv_dtype: str = "fp16"  # the pages: fp16, or int8 / fp8 (e4m3) codes with calibrated channel scales
    calib_windows: int = 8  # quantized pages: calibration windows the scales are taken over

    def __post_init__(self):
        sizes = page_sizes()
        if self.page_size not in sizes:
            raise UserError(f"paged_gqa page_size={self.page_size!r} is not one the paged attention op takes",
                            f"use page_size {', '.join(map(str, sizes))}")
        if self.kv_dtype not in KV_DTYPES:
            raise UserError(f"paged_gqa kv_dtype={self.kv_dtype!r} is not a KV page format",
                            f"use kv_dtype {', '.join(KV_DTYPES)}")
        if self.calib_windows < 1:
            raise UserError(f"paged_gqa calib_windows={self.calib_windows!r} must be positive", "e.g. 8")


def page_sizes() -> tuple[int, ...]:
    """The page sizes the op takes: its paged-attention kernels' (plugins/limits.json, their one definition)."""
    return tuple(kernel_limits()["paged_attention"]["block_sizes"])


class SharedBufferGQA(EsGqaRule):
    """Root: a com.enginesmith.GroupQueryAttention whose past K/V are graph inputs carried to graph outputs."""

    name = "es_gqa->paged_gqa"

    def check_inputs(self, node: ir.Node, ins: dict[str, ir.Value]) -> str | None:
        missing = [name for name, v in ins.items() if v is None]
        if missing:
            return f"has no {', '.join(missing)}"
        for name, want in (("seqlens_k", SEQLENS), ("total_len", TOTAL)):
            if not ins[name].is_graph_input() or ins[name].name != want:
                return f"{name} is not the graph input {want!r} (lower_gqa's interface)"
        outputs = {id(v) for v in node.graph.outputs}
        for past, present in ((ins["past_k"], node.outputs[1]), (ins["past_v"], node.outputs[2])):
            reason = kv_buffer_reason(node, past)
            if reason:
                return reason
            if id(present) not in outputs:
                return f"the present of {past.name} is not a graph output"
        cos = match.constant(ins["cos"])
        if cos is None or len(cos.shape) != 2 or 2 * cos.shape[1] != ins["past_k"].shape[3]:
            return "the cos cache is not a constant [positions, D / 2] table"
        head_sizes = kernel_limits()["paged_attention"]["head_sizes"]
        if ins["past_k"].shape[3] not in head_sizes:
            return f"head size {ins['past_k'].shape[3]} is not one the paged attention op takes ({head_sizes})"
        return None


def kv_buffer_reason(node: ir.Node, past: ir.Value) -> str | None:
    """Why `past` is not a KV buffer the runtime binds for `node` alone: a graph input [B, Hkv, C, D]
    with static Hkv and D that no other node reads; None if it is."""
    if past is None or not past.is_graph_input():
        return f"{getattr(past, 'name', 'a past K/V')} is not a graph input"
    others = sorted({u.node.op_type for u in past.uses() if u.node is not node})
    if others:
        return f"{past.name} is read by {', '.join(others)} besides the attention"
    shape = past.shape
    if shape is None or shape.rank() != 4 or not all(isinstance(shape[i], int) for i in (1, 3)):
        return f"{past.name} is not [B, Hkv, C, D] with static Hkv and D"
    return None


def _graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _refuse(model: ir.Model, found: list[Match], rejected) -> None:
    """Refuse a graph the paged engine cannot run, naming the first layer at fault and why."""
    graph = model.graph
    if _graph_input(graph, io_names.BLOCK_TABLES) is not None:
        raise UserError("the graph already has a paged KV layout", "apply paged_gqa to a dense CUDA-lowered graph")
    leftover = [n for n in graph if n.op_type == "GroupQueryAttention" and n.domain == MS_DOMAIN]
    if leftover:
        _, reasons = match.find(model, PackedRotaryGQA())
        why = next((r.reason for r in reasons if r.root is leftover[0]), "ort_attention was not run")
        raise UserError(f"paged_gqa: attention {leftover[0].name!r} ({len(leftover)} layers) is ORT's "
                        f"GroupQueryAttention, not enginesmith's ({why}); the paged CUDA engine needs "
                        "enginesmith's attention op", f"run ort_attention first, or {FIX}")
    if rejected:
        r = rejected[0]
        raise UserError(f"paged_gqa cannot page attention {r.node!r} ({len(rejected)} layers): {r.reason}", FIX)
    if not found:
        raise UserError("paged_gqa found no com.enginesmith.GroupQueryAttention",
                        "run lower_gqa and ort_attention first")
    roots = {id(m.root) for m in found}
    for name in (SEQLENS, TOTAL):
        users = sorted({u.node.op_type for u in _graph_input(graph, name).uses() if id(u.node) not in roots})
        if users:
            raise UserError(f"paged_gqa: {name} is read by {', '.join(users)} besides the attention", FIX)


def _paged_inputs(graph: ir.Graph, blocks: int) -> tuple[ir.Value, ir.Value, ir.Value]:
    """block_tables [B, MB], context_lens [B], slot_mapping [B, S] (int32), right after input_ids."""
    ids = _graph_input(graph, io_names.INPUT_IDS)
    if ids is None or ids.shape is None or ids.shape.rank() != 2:
        raise UserError("paged_gqa: the graph has no input_ids [B, S]", "export the model with the KV-cache signature")
    batch, seq = ids.shape[0], ids.shape[1]
    at = list(graph.inputs).index(ids) + 1
    made = []
    for i, (name, shape) in enumerate(((io_names.BLOCK_TABLES, [batch, blocks]), (io_names.CONTEXT_LENS, [batch]),
                                       (io_names.SLOT_MAPPING, [batch, seq]))):
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape(shape))
        graph.inputs.insert(at + i, value)
        made.append(value)
    return tuple(made)


def _page(graph: ir.Graph, namer: Namer, m: Match, page_size: int, meta, kv_dtype: str = "fp16",
          kv_scale: np.ndarray | None = None) -> None:
    """Replace one layer's GroupQueryAttention by PagedGroupQueryAttention over its pools (module doc);
    quantized pools get kv_scale [2, Hkv, D] as the op's ninth input."""
    node = m.root
    ins = dict(zip(ES_GQA_INPUTS, node.inputs))
    past_k, past_v = ins["past_k"], ins["past_v"]
    kv_heads, dim = past_k.shape[1], past_k.shape[3]
    scale = match.attr(node, "scale", 0.0) or 1.0 / math.sqrt(dim)
    attrs = {"num_heads": match.attr(node, "num_heads"), "kv_num_heads": match.attr(node, "kv_num_heads"),
             "scale": float(scale)}
    attrs |= {name: type(off)(match.attr(node, name)) for name, off in CARRIED.items()
              if match.attr(node, name, off) != off}  # softcap, local_window_size: as the dense op has them
    inputs = [ins["qkv"], past_k, past_v, *meta, ins["cos"], ins["sin"]]
    if kv_scale is not None:
        inputs.append(add_initializer(graph, namer, f"{node.name or 'gqa'}_kv_scale", kv_scale))
    new = ir.Node(DOMAIN, "PagedGroupQueryAttention", inputs, to_attrs(attrs), num_outputs=3,
                  name=namer(f"{node.name or 'gqa'}_paged"))
    graph.insert_before(node, new)
    pool = ir.Shape([POOL_DIM, page_size, kv_heads, dim])
    for old, value in zip(node.outputs, new.outputs):
        replace_value(graph, old, value, namer(f"{old.name}_paged"))
    for value in (past_k, past_v, new.outputs[1], new.outputs[2]):
        value.shape = pool
        value.type = ir.TensorType(KV_DTYPES[kv_dtype])
    graph.remove(node, safe=True)


def _kv_scales(found: list[Match], params: PagedGqaParams, ctx: PassContext | None,
               capacity: int) -> list[np.ndarray | None]:
    """Each layer's kv_scale [2, Hkv, D] (None for fp16 pages), calibrated on the pass's input graph."""
    if params.kv_dtype == "fp16":
        return [None] * len(found)
    return kv_calibrate.attention_scales("paged_gqa", [m.root for m in found], params.kv_dtype,
                                         params.calib_windows, ctx, capacity)


@register("paged_gqa", PagedGqaParams, exact=False, calibrated=lambda p: p.kv_dtype != "fp16")
def paged_gqa(model: ir.Model, params: PagedGqaParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """com.enginesmith.GroupQueryAttention on shared KV buffers -> PagedGroupQueryAttention on page pools
    (block tables, context lengths, slot mapping), fp16 or quantized (kv_dtype, calibrated scales).
    Changes the graph's inputs; see the module doc."""
    params = params or PagedGqaParams()
    capacity = lowered_capacity(model, "paged_gqa")
    found, rejected = match.find(model, SharedBufferGQA())
    _refuse(model, found, rejected)
    kv_scales = _kv_scales(found, params, ctx, capacity)  # before any change: calibrated on the input graph
    graph = model.graph
    namer = Namer(graph)
    meta = _paged_inputs(graph, -(-capacity // params.page_size))
    for m, kv_scale in zip(found, kv_scales):  # collect the matches first, then change the graph
        _page(graph, namer, m, params.page_size, meta, params.kv_dtype, kv_scale)
    for name in (SEQLENS, TOTAL):  # read by nothing now
        graph.inputs.remove(_graph_input(graph, name))
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps(
        {"type": "paged", "io": PAGED_GQA_IO, "page_size": params.page_size, "capacity": capacity,
         **({"kv_dtype": params.kv_dtype} if params.kv_dtype != "fp16" else {})})
    return PassResult({"paged_gqa": len(found)})


__all__ = ["PagedGqaParams", "SharedBufferGQA", "page_sizes", "paged_gqa"]
