"""kv_layout=paged: the concat-grown KV cache -> `enginesmith.PagedAttention` over page pools.

Dimension legend: B rows, S new tokens, H query heads, Hkv key/value heads, D head size, BS page
size, NB pages in the pool, MB pages per row in the block table, L = MB * BS.

Per layer, before (dense; the cache grows by S every step):

    k ─ Concat(past_k [B,Hkv,P,D]) ─ present_k ─ [GQA repeat] ─┐
    v ─ Concat(past_v) ─────────── present_v ─ [GQA repeat] ─┤
    q ───────────────────────────────────────────── Attention(mask from attention_mask) ─ y

after (`lower=none`: the IR op, whose layout is the TensorRT plugin's, plugins/paged_attention):

    q, k, v ─ Transpose to [B,S,heads,D] ─┐
    past_k, past_v: pools [NB,BS,Hkv,D] ──┤
    block_tables [B,MB] int32 ────────────┼─ enginesmith.PagedAttention ─┬─ out [B,S,H,D] ─ Transpose ─ y
    context_lens [B] int32 ───────────────┤   (write new K/V through    ├─ present_k (the pool, in place)
    slot_mapping [B,S] int32 ─────────────┘    the slots, then attend)  └─ present_v

`attention_mask` leaves the graph (context_lens and the slots say everything); query column s of
row b sits at position context_lens[b] - S + s and attends causally (runtime/kv_paged.py).

Lowerings (the `lower` parameter, or the `lower_paged` pass):

  cpu   standard ops only, runs on any ONNX Runtime EP:
          ScatterND(pool, [page, offset] of Compress(slots, slots >= 0), Compress(k, ...))
          -> Gather(pool, block_tables) [B,MB,BS,Hkv,D] -> [B,Hkv,L,D]
          -> Attention(q, K, V, key_pos <= context_lens - S + s)
  cuda  com.microsoft.PagedAttention (ONNX Runtime CUDA EP, float16/bfloat16): tokens packed to
        [B*S, heads*D], cumulative_sequence_length = 0, S, 2S.., past_seqlens = context_lens - S
  trt   a TensorRT plugin node: op_type PagedAttention, plugin_version "1", plugin_namespace
        "enginesmith", attributes = the creator's fields (float16/bfloat16, head sizes and page
        sizes the plugin supports)

Exactness: with `lower=cpu` the pass is exact, and the pass manager compares the paged graph with
the dense graph before it (verify.compare drives it through paged_verify: the runtime's paged cache
over a prefill and decode steps, batch 2) and stops the pipeline on a mismatch. The other lowerings
do not run on ONNX Runtime's CPU EP, so they are not compared (nor is `verify=false`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx_ir as ir

from enginesmith.errors import UserError
from enginesmith.passes import match
from enginesmith.passes.edit import Namer
from enginesmith.passes.fuse_attention import ensure_opset, remove_dead_nodes, repeat_source
from enginesmith.passes.match import Match, Rule, gqa_repeat
from enginesmith.passes.registry import PassContext, PassResult, register

DOMAIN = "enginesmith"
TRT_DOMAIN = "trt.plugins"
MS_DOMAIN = "com.microsoft"
METADATA_KEY = "enginesmith.kv_layout"
LOWERINGS = ("cpu", "cuda", "trt", "none")
HALF = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
PERM = [0, 2, 1, 3]  # [B, heads, S, D] <-> [B, S, heads, D]


@dataclass(frozen=True)
class KVPagedParams:
    page_size: int = 16
    lower: str = "cpu"
    verify: bool = True  # let the pass manager compare the paged graph with the dense one (lower=cpu)

    def __post_init__(self):
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise UserError(f"kv_paged page_size={self.page_size!r} must be a positive integer",
                            "use 16, 32 or 64 (the sizes the TensorRT plugin supports)")
        if self.lower not in LOWERINGS:
            raise UserError(f"kv_paged lower={self.lower!r} is not one of {', '.join(LOWERINGS)}",
                            "use cpu (ONNX Runtime, any EP), cuda (com.microsoft.PagedAttention), trt or none")


@dataclass(frozen=True)
class LowerPagedParams:
    target: str = "cpu"

    def __post_init__(self):
        if self.target not in LOWERINGS[:3]:
            raise UserError(f"lower_paged target={self.target!r} is not cpu, cuda or trt",
                            "use cpu, cuda or trt")


class DenseKVAttention(Rule):
    """Root: a layer's Attention whose K/V are Concat(past input, new) [+ GQA repeat]."""

    def __init__(self, gqa: bool):
        self.gqa = gqa
        self.name = "dense_kv_attention" + ("+gqa" if gqa else "")

    def pattern(self, op, q, past_k, k_new, past_v, v_new):
        k = op.Concat(past_k, k_new, _allow_other_attributes=True, _outputs=["present_k"])
        v = op.Concat(past_v, v_new, _allow_other_attributes=True, _outputs=["present_v"])
        if self.gqa:
            k, v = gqa_repeat(op, k), gqa_repeat(op, v)
        return op.Attention(q, k, v, _allow_other_inputs=True, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        att = m.root
        outputs = {id(v) for v in att.graph.outputs}
        for name in ("past_k", "past_v"):
            if not m[name].is_graph_input():
                return f"{name} is not a graph input"
            shape = m[name].shape
            if shape is None or len(shape) != 4 or not all(isinstance(shape[d], int) for d in (1, 3)):
                return f"{name} has no static [B, Hkv, P, D] shape"
        for name in ("present_k", "present_v"):
            if id(m[name]) not in outputs:
                return f"{name} is not a graph output"
            if match.attr(m[name].producer(), "axis") not in (-2, 2):
                return "the KV concat is not along the sequence axis"
        if self.gqa and (repeat_source(att.inputs[1]) is not m["present_k"]
                         or repeat_source(att.inputs[2]) is not m["present_v"]):
            return "K/V expansion is not a GQA repeat along the head axis"
        q = m["q"]
        if q.shape is None or len(q.shape) != 4 or not isinstance(q.shape[1], int):
            return "query has no static [B, H, S, D] shape"
        if q.shape[1] % m["past_k"].shape[1]:
            return f"{q.shape[1]} query heads are not a multiple of {m['past_k'].shape[1]} KV heads"
        for name, default in (("is_causal", 0), ("softcap", 0.0), ("qk_matmul_output_mode", 0)):
            if match.attr(att, name, default) != default:
                return f"Attention has {name}={match.attr(att, name)} (the paged op supports plain softmax)"
        if len(att.inputs) > 4 and any(i is not None for i in att.inputs[4:]):
            return "Attention has its own past_key/past_value inputs"
        if any(o.uses() or o in att.graph.outputs for o in att.outputs[1:]):
            return "Attention's present/qk outputs are used"
        return None


RULES = [DenseKVAttention(True), DenseKVAttention(False)]


# ----------------------------------------------------------------------------- node building

def _attr(name: str, value) -> ir.Attr:
    if isinstance(value, ir.Attr):
        return value
    if isinstance(value, (bool, int, np.integer)):
        return ir.AttrInt64(name, int(value))
    if isinstance(value, float):
        return ir.AttrFloat32(name, value)
    if isinstance(value, str):
        return ir.AttrString(name, value)
    if isinstance(value, (list, tuple)):
        return ir.AttrInt64s(name, [int(v) for v in value])
    raise TypeError(f"attribute {name}: unsupported {type(value).__name__}")


class _Emit:
    """Makes nodes for one rewrite, collected in `nodes` (the caller inserts them)."""

    def __init__(self, graph: ir.Graph, namer: Namer, base: str):
        self.graph, self.namer, self.base = graph, namer, base
        self.nodes: list[ir.Node] = []

    def __call__(self, op: str, inputs, attrs: dict | None = None, dtype=None, shape=None, domain: str = "",
                 outputs: int = 1):
        node = ir.Node(domain, op, inputs, [_attr(k, v) for k, v in (attrs or {}).items()],
                       num_outputs=outputs, name=self.namer(f"{self.base}/{op}"))
        for out in node.outputs:
            out.name = self.namer(f"{self.base}/{op}_out")
        if dtype is not None:
            node.outputs[0].type = ir.TensorType(dtype)
        if shape is not None:
            node.outputs[0].shape = ir.Shape(shape)
        self.nodes.append(node)
        return node.outputs[0] if outputs == 1 else node.outputs

    def const(self, name: str, array) -> ir.Value:
        array = np.asarray(array)
        value = ir.Value(name=self.namer(f"{self.base}/{name}"), shape=ir.Shape(array.shape),
                         type=ir.TensorType(ir.DataType.from_numpy(array.dtype)))
        value.const_value = ir.Tensor(array, name=value.name)
        self.graph.register_initializer(value)
        return value


def _graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _layer_index(name: str, fallback: int) -> int:
    found = re.fullmatch(r"past_key_values\.(\d+)\.(key|value)", name or "")
    return int(found.group(1)) if found else fallback


# ----------------------------------------------------------------------------- the rewrite

def _metadata_inputs(graph: ir.Graph, batch) -> tuple[ir.Value, ir.Value, ir.Value]:
    seq = _graph_input(graph, "input_ids").shape[1]
    after = list(graph.inputs).index(_graph_input(graph, "position_ids"))
    made = []
    for i, (name, shape) in enumerate((("block_tables", [batch, "max_blocks"]), ("context_lens", [batch]),
                                       ("slot_mapping", [batch, seq]))):
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape(shape))
        graph.inputs.insert(after + 1 + i, value)
        made.append(value)
    return tuple(made)


def _paged_one(graph: ir.Graph, namer: Namer, m: Match, layer: int, page_size: int, meta) -> None:
    """Replace one matched layer by an enginesmith.PagedAttention node (see the module doc)."""
    att, past_k, past_v = m.root, m["past_k"], m["past_v"]
    q = m["q"]
    batch, heads, seq, dim = q.shape
    kv_heads = past_k.shape[1]
    dtype = q.type.dtype
    scale = match.attr(att, "scale", None) or 1.0 / math.sqrt(dim)
    emit = _Emit(graph, namer, f"paged_{layer}")
    q4 = emit("Transpose", [q], {"perm": PERM}, dtype, [batch, seq, heads, dim])
    k4 = emit("Transpose", [m["k_new"]], {"perm": PERM}, dtype, [batch, seq, kv_heads, dim])
    v4 = emit("Transpose", [m["v_new"]], {"perm": PERM}, dtype, [batch, seq, kv_heads, dim])
    for pool in (past_k, past_v):
        pool.shape = ir.Shape(["num_pages", page_size, kv_heads, dim])
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_size": dim, "block_size": page_size,
             "scale": float(scale), "write_kv": 1}
    out, k_out, v_out = emit("PagedAttention", [q4, k4, v4, past_k, past_v, *meta], attrs, domain=DOMAIN,
                             outputs=3)
    out.type, out.shape = ir.TensorType(dtype), ir.Shape([batch, seq, heads, dim])
    for value, pool in ((k_out, past_k), (v_out, past_v)):
        value.type, value.shape = pool.type, pool.shape
    y = emit("Transpose", [out], {"perm": PERM}, dtype, att.outputs[0].shape)
    for node in emit.nodes:
        graph.insert_before(att, node)
    att.outputs[0].replace_all_uses_with(y)
    for present, value, kind in ((m["present_k"], k_out, "key"), (m["present_v"], v_out, "value")):
        index = graph.outputs.index(present)
        present.name = namer(f"{present.name}_dense")
        value.name = f"present.{layer}.{kind}"
        graph.outputs[index] = value


def _fix_shape_readers(graph: ir.Graph, pools: list[ir.Value], input_ids: ir.Value) -> None:
    """Shape nodes the exporter hung on past inputs: the batch (dim 0) now comes from input_ids,
    Hkv/D are static; the past length has no meaning any more and must not be read."""
    for pool in pools:
        for use in list(pool.uses()):
            node = use.node
            if node.domain == DOMAIN and node.op_type == "PagedAttention":
                continue
            if node.op_type != "Shape":
                raise UserError(f"{pool.name} is read by {node.op_type} {node.name!r} besides the attention",
                                "use the dense KV layout for this graph")
            start, end = match.attr(node, "start", 0), match.attr(node, "end", None)
            start = start + 4 if start < 0 else start
            end = 4 if end is None else (end + 4 if end < 0 else end)
            if (start, end) != (0, 1):
                raise UserError(f"{node.name!r} reads dims {start}..{end - 1} of {pool.name} (the past length "
                                "drives more than the attention mask)", "use the dense KV layout for this graph")
            node.replace_input_with(use.idx, input_ids)


def _refuse(model: ir.Model, found: list[Match], rejected) -> None:
    graph = model.graph
    if _graph_input(graph, "block_tables") is not None:
        raise UserError("the graph already has a paged KV layout", "apply kv_paged to a dense graph")
    if _graph_input(graph, "write_indices") is not None:
        raise UserError("the graph has a ring KV layout", "apply kv_paged to the dense graph instead")
    for name in ("input_ids", "position_ids", "attention_mask"):
        if _graph_input(graph, name) is None:
            raise UserError(f"the graph has no input {name!r}", "export the model with the KV-cache signature")
    attention = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
    if not attention:
        raise UserError("the graph has no Attention op for kv_paged to rewrite",
                        "run fuse_attention first, or export at opset 23 or later")
    matched = {id(m.root) for m in found}
    missing = [n for n in attention if id(n) not in matched]
    if missing:
        reasons = {id(r.root): r.reason for r in rejected}
        why = reasons.get(id(missing[0]), "its K/V do not come from Concat(past input, new)")
        raise UserError(f"kv_paged cannot convert attention {missing[0].name!r} ({len(missing)} of "
                        f"{len(attention)} layers): {why}", "use the dense KV layout for this graph")


def rewrite_paged(model: ir.Model, page_size: int) -> dict[str, int]:
    """Dense graph -> enginesmith.PagedAttention graph (lower=none); returns counts."""
    found, rejected = match.find_all(model, RULES)
    _refuse(model, found, rejected)
    graph = model.graph
    namer = Namer(graph)
    meta = _metadata_inputs(graph, _graph_input(graph, "input_ids").shape[0])
    pools = []
    for i, m in enumerate(found):  # collect the matches first, then change the graph
        _paged_one(graph, namer, m, _layer_index(m["past_k"].name, i), page_size, meta)
        pools += [m["past_k"], m["past_v"]]
    remove_dead_nodes(model)
    _fix_shape_readers(graph, pools, _graph_input(graph, "input_ids"))
    mask = _graph_input(graph, "attention_mask")
    if mask.uses():
        users = sorted({u.node.op_type for u in mask.uses()})
        raise UserError(f"attention_mask is still used by {users} after the paged rewrite",
                        "use the dense KV layout for this graph")
    graph.inputs.remove(mask)
    model.opset_imports[DOMAIN] = 1
    return {"paged_layers": len(found)}


# ----------------------------------------------------------------------------- lowerings

def _paged_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in model.graph if n.domain == DOMAIN and n.op_type == "PagedAttention"]


def _int(node: ir.Node, name: str) -> int:
    return int(match.attr(node, name))


class _CpuShared:
    """Index and mask computations shared by every layer's decomposed PagedAttention."""

    def __init__(self, graph: ir.Graph, namer: Namer, node: ir.Node):
        tables, ctx, slots = node.inputs[5:8]
        bs = _int(node, "block_size")
        e = self.emit = _Emit(graph, namer, "paged_cpu")
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
    e = _Emit(graph, namer, node.name or "paged")
    row_shape = e.const("rows", np.array([-1, kv_heads, dim], np.int64))
    seq_shape = e.const("seq", np.array([0, -1, kv_heads, dim], np.int64))
    caches, seqs = [], []
    for new, cache in ((k, k_cache), (v, v_cache)):
        rows = e("Compress", [e("Reshape", [new, row_shape], dtype=dtype), shared.keep], {"axis": 0}, dtype)
        written = e("ScatterND", [cache, shared.index, rows], dtype=dtype, shape=cache.shape)
        pages = e("Gather", [written, tables], {"axis": 0}, dtype)                       # [B,MB,BS,Hkv,D]
        seqs.append(e("Transpose", [e("Reshape", [pages, seq_shape], dtype=dtype)], {"perm": PERM}, dtype))
        caches.append(written)
    attn = e("Attention", [e("Transpose", [q], {"perm": PERM}, dtype), *seqs, shared.mask],
             {"scale": float(match.attr(node, "scale", 0.0)) or 1.0 / math.sqrt(dim)}, dtype)
    out = e("Transpose", [attn], {"perm": PERM}, dtype)
    ir.convenience.replace_nodes_and_values(graph, node, [node], e.nodes, list(node.outputs), [out, *caches])


def _lower_cuda(graph: ir.Graph, namer: Namer, node: ir.Node) -> None:
    q, k, v, k_cache, v_cache, tables, ctx, slots = node.inputs
    heads, kv_heads, dim = _int(node, "num_heads"), _int(node, "num_kv_heads"), _int(node, "head_size")
    dtype = q.type.dtype
    if dtype not in HALF:
        raise UserError(f"com.microsoft.PagedAttention runs float16/bfloat16 only; {node.name!r} is {dtype}",
                        "export with --dtype fp16 (or bf16), or lower for cpu")
    i32, i64 = ir.DataType.INT32, ir.DataType.INT64
    e = _Emit(graph, namer, node.name or "paged")
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
    """The PagedAttention plugin's limits as the C++ layer defines them: through the kernels
    library when it is built, else read from plugins/paged_attention/paged_attention.h."""
    try:
        from enginesmith.plugins import kernels

        lim = kernels.paged_attention_limits()
        return {"head_sizes": lim.head_sizes, "block_sizes": lim.block_sizes, "max_query_len": lim.max_query_len}
    except Exception:  # library not built (no nvcc here), or not loadable
        header = Path(__file__).resolve().parents[1] / "plugins" / "paged_attention" / "paged_attention.h"
        if not header.is_file():
            raise UserError("cannot read the PagedAttention plugin's limits (no kernels library, no header)",
                            "build the plugins (plugins/README.md) before lowering for TensorRT") from None
        text = header.read_text()

        def ints(name):
            return tuple(int(x) for x in re.search(name + r"\[\]\s*=\s*\{([^}]*)\}", text).group(1).split(","))

        return {"head_sizes": ints("kSupportedHeadSizes"), "block_sizes": ints("kSupportedBlockSizes"),
                "max_query_len": int(re.search(r"kMaxQueryLen\s*=\s*(\d+)", text).group(1))}


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
    layout = json.loads(model.metadata_props.get(METADATA_KEY, "{}"))
    layout["lower"] = target
    model.metadata_props[METADATA_KEY] = json.dumps(layout)
    return len(nodes)


# ----------------------------------------------------------------------------- the passes

@register("kv_paged", KVPagedParams, exact=lambda p: p.lower == "cpu" and p.verify)
def kv_paged(model: ir.Model, params: KVPagedParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """Dense concat KV cache -> enginesmith.PagedAttention over page pools + block tables + slot
    mapping, lowered for cpu (standard ops), cuda (com.microsoft.PagedAttention) or trt (plugin).
    Exact; with lower=cpu the pass manager compares it with the dense graph."""
    params = params or KVPagedParams()
    counts = rewrite_paged(model, params.page_size)
    model.metadata_props[METADATA_KEY] = json.dumps({"type": "paged", "page_size": params.page_size,
                                                     "lower": "none"})
    ensure_opset(model, 23)
    if params.lower != "none":
        counts["lowered"] = lower_paged_graph(model, params.lower)
    return PassResult(counts)


@register("lower_paged", LowerPagedParams, exact=False)
def lower_paged(model: ir.Model, params: LowerPagedParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """enginesmith.PagedAttention (kv_paged:lower=none) -> cpu decomposition, com.microsoft.PagedAttention
    (cuda) or the TensorRT plugin node (trt). Not compared by the manager: its input does not run on ORT."""
    params = params or LowerPagedParams()
    return PassResult({"lowered": lower_paged_graph(model, params.target)})


def kv_paged_proto(proto, page_size: int = 16, lower: str = "cpu"):
    """kv_paged on an onnx.ModelProto (not compared: no pass manager): (new ModelProto, counts)."""
    model = ir.from_proto(proto)
    result = kv_paged(model, KVPagedParams(page_size, lower))
    return ir.to_proto(model), result.counts
