"""kv_layout=ring: the concat-grown KV cache -> fixed sink + window caches (StreamingLLM).

Dimension legend: B batch, S new tokens, Hkv key/value heads, D head size, s sinks, w window,
C = s + w cache slots.

Per layer, before (dense; the cache grows by S every step):

    k ─ RotaryEmbedding(position_ids) ─ Concat(past_k) ─ present_k ─ [GQA repeat] ─┐
    v ───────────────────────────────── Concat(past_v) ─ present_v ─ [GQA repeat] ─┤
    q ─ RotaryEmbedding(position_ids) ─────────────────────────────────────── Attention(mask from attention_mask)

after (ring; nothing grows, keys are stored unrotated):

    k ─┬ TensorScatter(past_k [B,Hkv,w,D], write_indices, circular) ─ present_k ──────┐
       └ Where(sink_sources >= 0, GatherElements(k), past_sinks_k [B,Hkv,s,D]) ─ present_sinks_k
                                   Concat(sinks, window) [B,Hkv,C,D] ─ RotaryEmbedding(cache_positions) ─┐
    v ─┬ TensorScatter(past_v) ─ present_v ───── Concat(sinks, window) ─────────────────────────────────┤
       └ Where(..., past_sinks_v) ─ present_sinks_v                                                     │
    q ─ RotaryEmbedding(position_ids) ───────── Attention(q, K, V, occupied & cache_pos <= query_pos) ─┘

The new tokens are written first, then attended to with the whole cache: the chunk evicts the
oldest window entries it needs room for, which is StreamingLLM's `evict_for_space` followed by
appending the chunk (a chunk is therefore at most `window` tokens). RoPE positions are positions
in the cache (sinks 0..s-1, then the window oldest first), bounded by C, so a stream of any length
never loses precision. Which slots are occupied, the slots' positions, where the window write
starts and which chunk token fills which sink are inputs computed by the runtime's RingKVCache:

    input_ids [B, S]   position_ids [B, S]: each new token's position in the cache (pads: 0)
    attention_mask [B, C]: 1 = slot holds a token after this step's write (order: sinks, window)
    cache_positions [B, C]   write_indices [B]: window slot of the chunk's first column
    sink_sources [B, s]: chunk column that fills sink slot j this step, or -1 (s > 0 only)
    past_key_values.{i}.key/value [B, Hkv, w, D]   past_sinks.{i}.key/value [B, Hkv, s, D]
    -> logits, present.{i}.key/value (same shapes: bind them to the past buffers, TensorScatter
       updates in place), present_sinks.{i}.key/value

Sliding-window models (Mistral with a window W, every layer; the export records it in the graph's
`enginesmith.attention` metadata): the ring is then the exact sliding window, not an approximation.
RoPE scores depend only on q - k, and with no sinks the window's positions in the cache are the
stream's positions shifted by a constant, so the mask gets one more term, cache_pos > query_pos - W,
and each layer keeps `window` (>= W) slots instead of the whole context. Exact while every chunk
after the first has at most window - W + 1 tokens (a decode step always; a chunk evicts the oldest
entries before attending). Sinks would change what the model sees and are refused; so are models
whose sliding and global layers alternate (Gemma 2/3: one ring size cannot hold both).

Needs the standard Attention and RotaryEmbedding ops (an opset >= 23 export, or fuse_attention
first); a model without rotary embeddings (GPT-2's learned positions) cannot move its tokens'
positions and is refused. The pass is exact before any eviction (tested against the dense graph).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.export import attention_meta
from enginesmith.passes.kv.dense_attention import dense_kv_rules, layer_index
from enginesmith.passes.kv.ring_rope import RopeCloner, rotary_for_cache
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, Namer, add_initializer, add_node, ensure_opset, remove_dead_nodes
from enginesmith.passes.machinery.match import Match
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

RING_OPSET = 24  # TensorScatter


@dataclass(frozen=True)
class KVRingParams:
    sinks: int = 4
    window: int = 1020

    def __post_init__(self):
        if not isinstance(self.sinks, int) or self.sinks < 0:
            raise UserError(f"kv_ring sinks={self.sinks!r} is negative",
                            "use 0 or more attention-sink tokens (StreamingLLM uses 4)")
        if not isinstance(self.window, int) or self.window < 1:
            raise UserError(f"kv_ring window={self.window!r} must be at least 1 token",
                            "use a window of recent tokens, e.g. 1020")

    @property
    def capacity(self) -> int:
        return self.sinks + self.window


RULES = dense_kv_rules(rotary_keys=True, plain_softmax=("is_causal",),
                       why_plain="its mask is not the exported one")


@dataclass
class _Inputs:
    """The ring's shared graph inputs and the values built from them once for all layers."""

    mask: ir.Value               # [B, 1, S, C] bool: what each new token attends to
    cache_positions: ir.Value    # [B, C]
    write_indices: ir.Value      # [B]
    sink_sources: ir.Value | None  # [B, s]
    sink_write: ir.Value | None  # [B, 1, s, 1] bool
    sink_index: ir.Value | None  # [B, 1, s, 1] int64, clamped to >= 0


def _graph_input(graph: ir.Graph, name: str) -> ir.Value:
    for value in graph.inputs:
        if value.name == name:
            return value
    raise UserError(f"the graph has no input {name!r}", "export the model with the KV-cache signature")


def _new_input(graph: ir.Graph, name: str, dtype: ir.DataType, shape: list, after: ir.Value) -> ir.Value:
    value = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
    graph.inputs.insert(list(graph.inputs).index(after) + 1, value)
    return value


def _shared_inputs(graph: ir.Graph, namer: Namer, params: KVRingParams, batch, sliding: int | None) -> _Inputs:
    mask_in = _graph_input(graph, io_names.ATTENTION_MASK)
    positions = _graph_input(graph, io_names.POSITION_IDS)
    c = params.capacity
    mask_in.shape = ir.Shape([batch, c])
    cache_positions = _new_input(graph, io_names.CACHE_POSITIONS, ir.DataType.INT64, [batch, c], positions)
    write_indices = _new_input(graph, io_names.WRITE_INDICES, ir.DataType.INT64, [batch], cache_positions)
    sink_sources = None
    if params.sinks:
        sink_sources = _new_input(graph, io_names.SINK_SOURCES, ir.DataType.INT64, [batch, params.sinks],
                                  write_indices)

    def const(name, array):
        return add_initializer(graph, namer, name, np.asarray(array, dtype=np.int64))

    axes_12, axes_13 = const("ring_axes_12", [1, 2]), const("ring_axes_13", [1, 3])
    occupied = add_node(graph, namer, "Cast", [mask_in], {"to": int(ir.DataType.BOOL)},
                        dtype=ir.DataType.BOOL, base="ring_occupied")
    occupied = add_node(graph, namer, "Unsqueeze", [occupied, axes_12], dtype=ir.DataType.BOOL)
    key_pos = add_node(graph, namer, "Unsqueeze", [cache_positions, axes_12], dtype=ir.DataType.INT64)
    query_pos = add_node(graph, namer, "Unsqueeze", [positions, axes_13], dtype=ir.DataType.INT64)
    causal = add_node(graph, namer, "LessOrEqual", [key_pos, query_pos], dtype=ir.DataType.BOOL)
    mask = add_node(graph, namer, "And", [occupied, causal], dtype=ir.DataType.BOOL, base="ring_mask")
    if sliding is not None:  # the model's own window: query_pos - key_pos < W
        distance = add_node(graph, namer, "Sub", [query_pos, key_pos], dtype=ir.DataType.INT64)
        near = add_node(graph, namer, "Less", [distance, const("ring_sliding_window", sliding)],
                        dtype=ir.DataType.BOOL)
        mask = add_node(graph, namer, "And", [mask, near], dtype=ir.DataType.BOOL, base="ring_window_mask")
    sink_write = sink_index = None
    if sink_sources is not None:
        zero = const("ring_zero", 0)
        writes = add_node(graph, namer, "GreaterOrEqual", [sink_sources, zero], dtype=ir.DataType.BOOL)
        sink_write = add_node(graph, namer, "Unsqueeze", [writes, axes_13], dtype=ir.DataType.BOOL,
                              base="ring_sink_write")
        clamped = add_node(graph, namer, "Max", [sink_sources, zero], dtype=ir.DataType.INT64)
        sink_index = add_node(graph, namer, "Unsqueeze", [clamped, axes_13], dtype=ir.DataType.INT64,
                              base="ring_sink_index")
    return _Inputs(mask, cache_positions, write_indices, sink_sources, sink_write, sink_index)


def _ring_one(graph: ir.Graph, namer: Namer, shared: _Inputs, params: KVRingParams, m: Match,
              layer: int, cloner: RopeCloner, expanded_index: dict) -> None:
    """Rewrite one matched layer (see the module doc)."""
    att = m.root
    rope = m["k_rot"].producer()
    batch = m["past_k"].shape[0]
    caches = {}
    for kind, past, new, present in (("key", m["past_k"], m["k_new"], m["present_k"]),
                                     ("value", m["past_v"], m["v_new"], m["present_v"])):
        heads, dim = past.shape[1], past.shape[3]
        past.shape = ir.Shape([batch, heads, params.window, dim])
        window = add_node(graph, namer, "TensorScatter", [past, new, shared.write_indices],
                          {"axis": 2, "mode": "circular"}, like=past, shape=past.shape,
                          base=f"ring_window_{kind}_{layer}")
        index = graph.outputs.index(present)
        present.name = namer(f"{present.name}_dense")
        window.name = io_names.present_name(layer, kind)
        graph.outputs[index] = window
        cache = window
        if params.sinks:
            sinks_in = ir.Value(name=io_names.past_sinks_name(layer, kind), type=past.type,
                                shape=ir.Shape([batch, heads, params.sinks, dim]))
            graph.inputs.append(sinks_in)
            key = (heads, dim)
            if key not in expanded_index:
                shape = add_node(graph, namer, "Shape", [sinks_in], dtype=ir.DataType.INT64)
                expanded_index[key] = add_node(graph, namer, "Expand", [shared.sink_index, shape],
                                               dtype=ir.DataType.INT64)
            gathered = add_node(graph, namer, "GatherElements", [new, expanded_index[key]], {"axis": 2},
                                like=past, shape=sinks_in.shape)
            sinks = add_node(graph, namer, "Where", [shared.sink_write, gathered, sinks_in], like=past,
                             shape=sinks_in.shape, base=f"ring_sinks_{kind}_{layer}")
            sinks.name = io_names.present_sinks_name(layer, kind)
            graph.outputs.append(sinks)
            cache = add_node(graph, namer, "Concat", [sinks, window], {"axis": 2}, like=past,
                             shape=ir.Shape([batch, heads, params.capacity, dim]))
        caches[kind] = cache
    keys = rotary_for_cache(graph, namer, rope, caches["key"], shared.cache_positions, cloner)
    att.replace_input_with(1, keys)
    att.replace_input_with(2, caches["value"])
    if len(att.inputs) > 3:
        att.replace_input_with(3, shared.mask)
    else:
        att.resize_inputs(4)
        att.replace_input_with(3, shared.mask)


def _sliding_window(model: ir.Model, params: KVRingParams) -> int | None:
    """The model's own sliding window W when every layer slides by the same W (None: no window);
    a UserError for what the ring cannot hold exactly (see the module doc)."""
    layers = attention_meta.layers(model.metadata_props)
    windows = {layer.window for layer in layers}
    if not windows or windows == {None}:
        return None
    if len(windows) > 1:
        raise UserError("kv_ring cannot keep this model's attention: " + str(attention_meta.sliding_reason(
            model.metadata_props, "one ring size for all layers")) + " (sliding and global layers alternate, "
            "and global layers need the whole context)", "use the dense KV layout for this model")
    (window,) = windows
    if params.sinks:
        raise UserError(f"kv_ring sinks={params.sinks} on a model with a sliding window of {window}: sinks would "
                        "let tokens see what the model never saw", "use --sinks 0 for sliding-window models")
    if params.window < window:
        raise UserError(f"kv_ring window={params.window} is smaller than the model's sliding window of {window}",
                        f"use --kv-window {window} or more (e.g. {2 * window})")
    return window


def _refuse(model: ir.Model, found: list[Match], rejected) -> None:
    """A ring layout must cover every layer: explain what stops it."""
    attention = [n for n in model.graph if n.op_type == "Attention"]
    if io_names.WRITE_INDICES in {v.name for v in model.graph.inputs}:
        raise UserError("the graph already has a ring KV layout", "apply kv_ring to a dense graph")
    if not attention:
        unfused = attention_meta.unfused_reason(model.metadata_props)
        if unfused:
            raise UserError(f"kv_ring needs an Attention op: {unfused}", "use the dense KV layout for this model")
        raise UserError("the graph has no Attention op for kv_ring to rewrite",
                        "run fuse_attention first, or export at opset 23 or later")
    if not any(n.op_type == "RotaryEmbedding" for n in model.graph):
        raise UserError("kv_ring needs rotary position embeddings as RotaryEmbedding ops (positions are "
                        "moved to the tokens' places in the cache); this graph has none (learned absolute "
                        "positions, as GPT-2, or a RoPE variant the exporter leaves unfused, as Phi-3's "
                        "LongRoPE)", "use the dense KV layout for this model")
    matched = {id(m.root) for m in found}
    missing = [n for n in attention if id(n) not in matched]
    reasons = {id(r.root): r.reason for r in rejected}
    if missing:
        first = missing[0]
        why = reasons.get(id(first), "its K/V do not come from RotaryEmbedding + Concat(past, new)")
        raise UserError(f"kv_ring cannot convert attention {first.name!r} ({len(missing)} of "
                        f"{len(attention)} layers): {why}", "use the dense KV layout for this graph")


def _check_inputs_consumed(model: ir.Model) -> None:
    """After the rewrite, the dense inputs must feed only the ring's own nodes."""
    for value in model.graph.inputs:
        if value.name == io_names.ATTENTION_MASK:
            users = {u.node.op_type for u in value.uses()}
            if not users <= {"Cast"}:
                raise UserError(f"attention_mask is still used by {sorted(users)} after the ring "
                                "rewrite", "use the dense KV layout for this graph")
        if io_names.is_past(value.name):
            # The exporter takes the batch size from a past input's shape: that dim is unchanged.
            users = {u.node.op_type for u in value.uses()
                     if not (u.node.op_type == "Shape" and _shape_skips_sequence(u.node))}
            if users != {"TensorScatter"}:
                raise UserError(f"{value.name} is read by {sorted(users)} besides the cache update",
                                "use the dense KV layout for this graph")


def _shape_skips_sequence(node: ir.Node) -> bool:
    """A Shape node that does not read dim 2 (the past length, whose meaning the ring changes)."""
    start, end = match.attr(node, "start", 0), match.attr(node, "end", None)
    start = start + 4 if start < 0 else start
    end = 4 if end is None else (end + 4 if end < 0 else end)
    return end <= 2 or start >= 3


@register("kv_ring", KVRingParams, exact=True)
def kv_ring(model: ir.Model, params: KVRingParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """Dense concat KV cache -> StreamingLLM sink + window ring buffers (TensorScatter, opset 24)."""
    params = params or KVRingParams()
    found, rejected = match.find_all(model, RULES)
    _refuse(model, found, rejected)
    sliding = _sliding_window(model, params)
    graph = model.graph
    namer = Namer(graph)
    batch = found[0]["past_k"].shape[0]
    shared = _shared_inputs(graph, namer, params, batch, sliding)
    cloner = RopeCloner(graph, namer, _graph_input(graph, io_names.POSITION_IDS), shared.cache_positions, "cache")
    expanded: dict = {}
    for i, m in enumerate(found):  # collect the matches first, then change the graph
        _ring_one(graph, namer, shared, params, m, layer_index(m, i), cloner, expanded)
    remove_dead_nodes(model)
    graph.sort()
    _check_inputs_consumed(model)
    ensure_opset(model, RING_OPSET)
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps(
        {"type": "ring", "sinks": params.sinks, "window": params.window, "capacity": params.capacity,
         **({"sliding_window": sliding, "max_exact_chunk": params.window - sliding + 1} if sliding else {})})
    return PassResult({"ring_layers": len(found), **({"sliding_window": sliding} if sliding else {})}, rejected)
