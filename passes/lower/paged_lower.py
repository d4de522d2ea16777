"""lower_paged: `enginesmith.PagedAttention` (made by kv/paged_rewrite.py) -> a backend's ops. The kv_paged
pass lowers the same way in one step (its `lower` parameter), through `lower_paged_graph`.

Inputs of the op: q [B,S,H,D], k, v [B,S,Hkv,D], the pools k_cache, v_cache [NB,BS,Hkv,D],
block_tables [B,MB], context_lens [B], slot_mapping [B,S] (int32); outputs y [B,S,H,D] and the two
pools, written in place. L = MB * BS positions a row's block table covers.

  cpu   standard ops only, runs on any ONNX Runtime EP (the index and mask part is shared by all
        layers):
          ScatterND(pool, [page, offset] of Compress(slots, slots >= 0), Compress(k, ...))
          -> Gather(pool, block_tables) [B,MB,BS,Hkv,D] -> [B,Hkv,L,D]
          -> Attention(q, K, V, key_pos <= context_lens - S + s)
  cuda  com.microsoft.PagedAttention (ONNX Runtime CUDA EP, float16/bfloat16): tokens packed to
        [B*S, heads*D], cumulative_sequence_length = 0, S, 2S.., past_seqlens = context_lens - S
  trt   a TensorRT plugin node: op_type PagedAttention, plugin_version "1", plugin_namespace
        "enginesmith", attributes = the creator's fields (float16/bfloat16, head sizes and page
        sizes the plugin supports: `plugin_limits`)

A lowering records its target in the graph's kv_layout metadata ("lower").
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.core.io_names import GRAPH_DOMAIN as DOMAIN, MS_DOMAIN, TRT_DOMAIN
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, SWAP_HEADS_SEQ, Emit, Namer
from enginesmith.passes.machinery.registry import PassContext, PassResult, register
from enginesmith.plugins.limits import limits as kernel_limits

TARGETS = ("cpu", "cuda", "trt")
HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)


@dataclass(frozen=True)
class LowerPagedParams:
    target: str = "cpu"

    def __post_init__(self):
        if self.target not in TARGETS:
            raise UserError(f"lower_paged target={self.target!r} is not cpu, cuda or trt",
                            "use cpu, cuda or trt")


def _paged_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]


def _int(node: ir.Node, name: str) -> int:
    return int(match.attr(node, name))


class _CpuShared:
    """Index and mask computations shared by every layer's decomposed PagedAttention."""

    def __init__(self, graph: ir.Graph, namer: Namer, node: ir.Node):
        tables, ctx, slots = node.inputs[5:8]
        bs = _int(node, "block_size")
        e = self.emit = Emit(graph, namer, "paged_cpu")
        i64 = ir.DataType.INT64
        zero, one, bs_c = e.const("zero", np.array(0, np.int64)), e.const("one", np.array(1, np.int64)), \
            e.const("block_size", np.array(bs, np.int64))
        width = e("Squeeze", [e("Shape", [slots], {"start": 1, "end": 2}, i64)], dtype=i64)   # S
        flat = e("Cast", [e("Reshape", [slots, e.const("flat", np.array([-1], np.int64))])], {"to": int(i64)}, i64)
        self.keep = e("GreaterOrEqual", [flat, zero], dtype=ir.DataType.BOOL)                  # [B*S]
        written = e("Compress", [flat, self.keep], {"axis": 0}, i64)                           # [T]
        axis1 = e.const("axis1", np.array([1], np.int64))
        page = e("Unsqueeze", [e("Div", [written, bs_c], dtype=i64), axis1], dtype=i64)
        offset = e("Unsqueeze", [e("Mod", [written, bs_c], dtype=i64), axis1], dtype=i64)
        self.index = e("Concat", [page, offset], {"axis": 1}, i64)                             # [T, 2]
        length = e("Mul", [e("Squeeze", [e("Shape", [tables], {"start": 1, "end": 2}, i64)], dtype=i64), bs_c],
                   dtype=i64)                                                                   # L
        key_pos = e("Range", [zero, length, one], dtype=i64)                                   # [L]
        key_pos = e("Reshape", [key_pos, e.const("key_shape", np.array([1, 1, 1, -1], np.int64))], dtype=i64)
        first = e("Sub", [e("Cast", [ctx], {"to": int(i64)}, i64), width], dtype=i64)         # [B]
        query_pos = e("Add", [e("Unsqueeze", [first, axis1], dtype=i64),
                              e("Unsqueeze", [e("Range", [zero, width, one], dtype=i64),
                                              e.const("axis0", np.array([0], np.int64))], dtype=i64)], dtype=i64)
        query_pos = e("Unsqueeze", [query_pos, e.const("axes13", np.array([1, 3], np.int64))], dtype=i64)
        self.mask = e("LessOrEqual", [key_pos, query_pos], dtype=ir.DataType.BOOL)            # [B,1,S,L]
        for n in e.nodes:
            graph.append(n)


def _lower_cpu(graph: ir.Graph, namer: Namer, node: ir.Node, shared: _CpuShared) -> None:
    q, k, v, k_cache, v_cache, tables = node.inputs[:6]
    kv_heads, dim = _int(node, "num_kv_heads"), _int(node, "head_size")
    dtype = q.type.dtype
    e = Emit(graph, namer, node.name or "paged")
    row_shape = e.const("rows", np.array([-1, kv_heads, dim], np.int64))
    seq_shape = e.const("seq", np.array([0, -1, kv_heads, dim], np.int64))
    caches, seqs = [], []
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = e("Compress", [e("Reshape", [new, row_shape], dtype=dtype), shared.keep], {"axis": 0}, dtype)
        written = e("ScatterND", [cache, shared.index, rows], dtype=dtype, shape=cache.shape)
        pages = e("Gather", [written, tables], {"axis": 0}, dtype)                       # [B,MB,BS,Hkv,D]
        seqs.append(e("Transpose", [e("Reshape", [pages, seq_shape], dtype=dtype)], {"perm": SWAP_HEADS_SEQ}, dtype))
        caches.append(written)
    attn = e("Attention", [e("Transpose", [q], {"perm": SWAP_HEADS_SEQ}, dtype), *seqs, shared.mask],
             {"scale": float(match.attr(node, "scale", 0.0)) or 1.0 / math.sqrt(dim)}, dtype)
    out = e("Transpose", [attn], {"perm": SWAP_HEADS_SEQ}, dtype)
    ir.convenience.replace_nodes_and_values(graph, node, [node], e.nodes, list(node.outputs), [out, *caches])


def _lower_cuda(graph: ir.Graph, namer: Namer, node: ir.Node) -> None:
    q, k, v, k_cache, v_cache, tables, ctx, slots = node.inputs
    heads, kv_heads, dim = _int(node, "num_heads"), _int(node, "num_kv_heads"), _int(node, "head_size")
    dtype = q.type.dtype
    if dtype not in HALF:
        raise UserError(f"com.microsoft.PagedAttention runs float16/bfloat16 only; {node.name!r} is {dtype}",
                        "export with --dtype fp16 (or bf16), or lower for cpu")
    i32, i64 = ir.DataType.INT32, ir.DataType.INT64
    e = Emit(graph, namer, node.name or "paged")
    packed_q = e("Reshape", [q, e.const("q_rows", np.array([-1, heads * dim], np.int64))], dtype=dtype)
    kv_rows = e.const("kv_rows", np.array([-1, kv_heads * dim], np.int64))
    packed_k = e("Reshape", [k, kv_rows], dtype=dtype)
    packed_v = e("Reshape", [v, kv_rows], dtype=dtype)
    shape = e("Shape", [slots], dtype=i64)                                                     # [B, S]
    batch = e("Gather", [shape, e.const("b", np.array(0, np.int64))], {"axis": 0}, i64)
    width = e("Gather", [shape, e.const("s", np.array(1, np.int64))], {"axis": 0}, i64)
    one = e.const("one", np.array(1, np.int64))
    starts = e("Range", [e.const("zero", np.array(0, np.int64)), e("Add", [batch, one], dtype=i64), one], dtype=i64)
    cumulative = e("Cast", [e("Mul", [starts, width], dtype=i64)], {"to": int(i32)}, i32)         # [B+1]
    past = e("Sub", [ctx, e("Cast", [width], {"to": int(i32)}, i32)], dtype=i32)                 # [B]
    flat_slots = e("Reshape", [slots, e.const("flat", np.array([-1], np.int64))], dtype=i32)
    attrs = {"num_heads": heads, "kv_num_heads": kv_heads, "scale": float(match.attr(node, "scale", 0.0))
             or 1.0 / math.sqrt(dim), "is_causal": 1}
    out, k_out, v_out = e("PagedAttention", [packed_q, packed_k, packed_v, k_cache, v_cache, cumulative, past,
                                             tables, None, None, flat_slots], attrs, domain=MS_DOMAIN, outputs=3)
    out.type = ir.TensorType(dtype)
    y = e("Reshape", [out, e("Shape", [q], dtype=i64)], dtype=dtype)
    ir.convenience.replace_nodes_and_values(graph, node, [node], e.nodes, list(node.outputs), [y, k_out, v_out])


def plugin_limits() -> dict:
    """The PagedAttention plugin's limits (head_sizes, block_sizes, max_query_len) from plugins/limits.json,
    their one definition, which the kernels compile in: known without the kernels library (lowering
    runs on machines where it is not built). The lowering only refuses early with a reason; the
    TensorRT build loads the plugin anyway."""
    return dict(kernel_limits()["paged_attention"])


def _lower_trt(graph: ir.Graph, namer: Namer, node: ir.Node, limits: dict) -> None:
    dtype = node.inputs[0].type.dtype
    dim, bs = _int(node, "head_size"), _int(node, "block_size")
    where = f"PagedAttention {node.name!r}"
    if dtype not in HALF:
        raise UserError(f"{where}: the TensorRT plugin runs float16/bfloat16, the graph is {dtype}",
                        "export with --dtype fp16 (or bf16) before lowering for TensorRT")
    if dim not in limits["head_sizes"]:
        raise UserError(f"{where}: head size {dim} is not supported by the TensorRT plugin "
                        f"(supported: {', '.join(map(str, limits['head_sizes']))})",
                        "use the ONNX Runtime lowering (lower=cpu) for this model")
    if bs not in limits["block_sizes"]:
        raise UserError(f"{where}: page size {bs} is not supported by the TensorRT plugin "
                        f"(supported: {', '.join(map(str, limits['block_sizes']))})",
                        "use kv_paged:page_size=16, 32 or 64")
    fields = {a.name: a for a in node.attributes.values()}
    attrs = [*fields.values(), ir.AttrString("plugin_version", "1"), ir.AttrString("plugin_namespace", DOMAIN)]
    new = ir.Node(TRT_DOMAIN, "PagedAttention", list(node.inputs), attrs, num_outputs=3,
                  name=namer(f"{node.name or 'paged'}_trt"))
    ir.convenience.replace_nodes_and_values(graph, node, [node], [new], list(node.outputs), list(new.outputs))


def lower_paged_graph(model: ir.Model, target: str) -> int:
    """Lower every enginesmith.PagedAttention node for `target` (cpu | cuda | trt); returns the count."""
    nodes = _paged_nodes(model)
    if not nodes:
        return 0
    graph, namer = model.graph, Namer(model.graph)
    if len({_int(n, "block_size") for n in nodes}) != 1:
        raise UserError("PagedAttention nodes with different page sizes in one graph", "rebuild with kv_paged")
    if target == "cpu":
        shared = _CpuShared(graph, namer, nodes[0])
        for node in nodes:
            _lower_cpu(graph, namer, node, shared)
    elif target == "cuda":
        for node in nodes:
            _lower_cuda(graph, namer, node)
        model.opset_imports[MS_DOMAIN] = 1
    else:
        limits = plugin_limits()
        for node in nodes:
            _lower_trt(graph, namer, node, limits)
        model.opset_imports[TRT_DOMAIN] = 1
    graph.sort()
    if not any(n.domain == DOMAIN for n in graph):
        model.opset_imports.pop(DOMAIN, None)
    layout = json.loads(model.metadata_props.get(KV_LAYOUT_KEY, "{}"))
    layout["lower"] = target
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps(layout)
    return len(nodes)


@register("lower_paged", LowerPagedParams, exact=False)
def lower_paged(model: ir.Model, params: LowerPagedParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """enginesmith.PagedAttention (kv_paged:lower=none) -> cpu decomposition, com.microsoft.PagedAttention
    (cuda) or the TensorRT plugin node (trt). Not compared by the manager: its input does not run on ORT."""
    params = params or LowerPagedParams()
    return PassResult({"lowered": lower_paged_graph(model, params.target)})
