"""The paged KV rewrite: a concat-grown KV cache -> `enginesmith.PagedAttention` over page pools.

Dimension legend: B rows, S new tokens, H query heads, Hkv key/value heads, D head size, BS page
size, NB pages in the pool, MB pages per row in the block table.

Per layer, before (dense; the cache grows by S every step):

    k ─ Concat(past_k [B,Hkv,P,D]) ─ present_k ─ [GQA repeat] ─┐
    v ─ Concat(past_v) ─────────── present_v ─ [GQA repeat] ─┤
    q ───────────────────────────────────────────── Attention(mask from attention_mask) ─ y

after (the IR op, whose layout is the TensorRT plugin's, plugins/paged_attention):

    q, k, v ─ Transpose to [B,S,heads,D] ─┐
    past_k, past_v: pools [NB,BS,Hkv,D] ──┤
    block_tables [B,MB] int32 ────────────┼─ enginesmith.PagedAttention ─┬─ out [B,S,H,D] ─ Transpose ─ y
    context_lens [B] int32 ───────────────┤   (write new K/V through    ├─ present_k (the pool, in place)
    slot_mapping [B,S] int32 ─────────────┘    the slots, then attend)  └─ present_v

`attention_mask` leaves the graph (context_lens and the slots say everything); query column s of
row b sits at position context_lens[b] - S + s and attends causally (runtime/kv/kv_paged.py). Shape
nodes the exporter hung on the past inputs read the batch from input_ids instead. A graph where any
layer does not match, or where the past length drives more than the mask, is refused as a whole.
The node's attributes: num_heads, num_kv_heads, head_size, block_size (= BS), scale, write_kv = 1.
"""

from __future__ import annotations

import json
import math

import onnx_ir as ir

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.export import attention_meta
from enginesmith.core.io_names import GRAPH_DOMAIN as DOMAIN
from enginesmith.passes.kv.dense_attention import dense_kv_rules, layer_index
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, SWAP_HEADS_SEQ, Emit, Namer, ensure_opset, remove_dead_nodes
from enginesmith.passes.machinery.match import Match



RULES = dense_kv_rules(plain_softmax=("is_causal", "softcap", "qk_matmul_output_mode"), static_heads=True,
                       why_plain="the paged op supports plain softmax")


def _graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _metadata_inputs(graph: ir.Graph, batch) -> tuple[ir.Value, ir.Value, ir.Value]:
    seq = _graph_input(graph, io_names.INPUT_IDS).shape[1]
    after = list(graph.inputs).index(_graph_input(graph, io_names.POSITION_IDS))
    made = []
    for i, (name, shape) in enumerate(((io_names.BLOCK_TABLES, [batch, "max_blocks"]),
                                       (io_names.CONTEXT_LENS, [batch]),
                                       (io_names.SLOT_MAPPING, [batch, seq]))):
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
    emit = Emit(graph, namer, f"paged_{layer}")
    q4 = emit("Transpose", [q], {"perm": SWAP_HEADS_SEQ}, dtype, [batch, seq, heads, dim])
    k4 = emit("Transpose", [m["k_new"]], {"perm": SWAP_HEADS_SEQ}, dtype, [batch, seq, kv_heads, dim])
    v4 = emit("Transpose", [m["v_new"]], {"perm": SWAP_HEADS_SEQ}, dtype, [batch, seq, kv_heads, dim])
    for pool in (past_k, past_v):
        pool.shape = ir.Shape(["num_pages", page_size, kv_heads, dim])
    attrs = {"num_heads": heads, "num_kv_heads": kv_heads, "head_size": dim, "block_size": page_size,
             "scale": float(scale), "write_kv": 1}
    out, k_out, v_out = emit("PagedAttention", [q4, k4, v4, past_k, past_v, *meta], attrs, domain=DOMAIN,
                             outputs=3)
    out.type, out.shape = ir.TensorType(dtype), ir.Shape([batch, seq, heads, dim])
    for value, pool in ((k_out, past_k), (v_out, past_v)):
        value.type, value.shape = pool.type, pool.shape
    y = emit("Transpose", [out], {"perm": SWAP_HEADS_SEQ}, dtype, att.outputs[0].shape)
    for node in emit.nodes:
        graph.insert_before(att, node)
    att.outputs[0].replace_all_uses_with(y)
    for present, value, kind in ((m["present_k"], k_out, "key"), (m["present_v"], v_out, "value")):
        index = graph.outputs.index(present)
        present.name = namer(f"{present.name}_dense")
        value.name = io_names.present_name(layer, kind)
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
    if _graph_input(graph, io_names.BLOCK_TABLES) is not None:
        raise UserError("the graph already has a paged KV layout", "apply kv_paged to a dense graph")
    if _graph_input(graph, io_names.WRITE_INDICES) is not None:
        raise UserError("the graph has a ring KV layout", "apply kv_paged to the dense graph instead")
    for name in (io_names.INPUT_IDS, io_names.POSITION_IDS, io_names.ATTENTION_MASK):
        if _graph_input(graph, name) is None:
            raise UserError(f"the graph has no input {name!r}", "export the model with the KV-cache signature")
    sliding = attention_meta.sliding_reason(model.metadata_props, "the paged layout")
    if sliding:
        raise UserError(f"kv_paged cannot keep this model's attention: {sliding}",
                        "use the dense KV layout (the ring layout keeps only the window, for models whose "
                        "layers all slide)")
    attention = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
    if not attention:
        unfused = attention_meta.unfused_reason(model.metadata_props)
        if unfused:
            raise UserError(f"kv_paged needs an Attention op: {unfused}", "use the dense KV layout for this model")
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
    """Dense graph -> enginesmith.PagedAttention graph (lower=none), in place; returns counts."""
    found, rejected = match.find_all(model, RULES)
    _refuse(model, found, rejected)
    graph = model.graph
    namer = Namer(graph)
    meta = _metadata_inputs(graph, _graph_input(graph, io_names.INPUT_IDS).shape[0])
    pools = []
    for i, m in enumerate(found):  # collect the matches first, then change the graph
        _paged_one(graph, namer, m, layer_index(m, i), page_size, meta)
        pools += [m["past_k"], m["past_v"]]
    remove_dead_nodes(model)
    _fix_shape_readers(graph, pools, _graph_input(graph, io_names.INPUT_IDS))
    mask = _graph_input(graph, io_names.ATTENTION_MASK)
    if mask.uses():
        users = sorted({u.node.op_type for u in mask.uses()})
        raise UserError(f"attention_mask is still used by {users} after the paged rewrite",
                        "use the dense KV layout for this graph")
    graph.inputs.remove(mask)
    model.opset_imports[DOMAIN] = 1
    ensure_opset(model, 23)
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps({"type": "paged", "page_size": page_size, "lower": "none"})
    return {"paged_layers": len(found)}

