"""kv_layout h2o: a ring graph (kv_ring, sinks 0, window = budget) that also reports how much
attention each cache slot received, so the runtime can evict heavy-hitter style (H2O, Zhang et al.
2023). Dimension legend: B batch, H query heads, S new tokens, C cache slots.

Per layer i:

    Attention(q, K, V, mask) ─ Y                         (as kv_ring wrote it)
    Attention(q, K, V, mask, qk_matmul_output_mode=3) ─┬ Y
                                                       └ probs [B, H, S, C] ─ ReduceSum(axis 2) ─▶ attention_scores.{i} [B, H, C]

Mode 3 is the attention after softmax (masked slots get 0), so attention_scores.{i}[b, h, c] is
the attention mass slot c received from this step's queries. The ring graph already writes the
new tokens at `write_indices` (TensorScatter) and rotates keys by their slots' positions in the
cache: the runtime (runtime/kv/kv_h2o.py) picks which slot a new token overwrites and what positions
the slots hold, so evicting any slot needs no other graph change. Exact: Y is untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.passes.machinery.edit import KV_LAYOUT_KEY, Namer, add_initializer
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

SOFTMAX_OUTPUT = 3  # Attention-23 qk_matmul_output_mode: the probabilities after softmax


@dataclass(frozen=True)
class KVH2OParams:
    pass


@register("kv_h2o", KVH2OParams, exact=True)
def kv_h2o(model: ir.Model, params: KVH2OParams, ctx: PassContext) -> PassResult:
    """Expose each layer's attention mass per cache slot (attention_scores.{i}) of a ring graph."""
    graph = model.graph
    if io_names.WRITE_INDICES not in {v.name for v in graph.inputs}:
        raise UserError("kv_h2o reads the attention of a ring KV graph; this one has none",
                        "run kv_ring:sinks=0 first (build --kv h2o does)")
    if io_names.SINK_SOURCES in {v.name for v in graph.inputs}:
        raise UserError("kv_h2o needs a ring of no sinks (heavy hitters take their place)", "use kv_ring:sinks=0")
    attention = [n for n in graph if n.op_type == "Attention" and n.domain == ""]
    layers = sum(io_names.is_past(v.name) for v in graph.inputs) // 2
    if len(attention) != layers:
        raise UserError(f"kv_h2o found {len(attention)} Attention ops for {layers} layers",
                        "apply it to a graph exported by enginesmith and rewritten by kv_ring")
    namer = Namer(graph)
    axes = add_initializer(graph, namer, "h2o_query_axis", np.array([2], np.int64))
    for i, old in enumerate(attention):
        if len(old.outputs) > 3 and old.outputs[3].uses():
            raise UserError(f"attention {old.name!r} already reports its scores", "apply kv_h2o once")
        attrs = [a for name, a in old.attributes.items() if name != "qk_matmul_output_mode"]
        attrs.append(ir.AttrInt64("qk_matmul_output_mode", SOFTMAX_OUTPUT))
        new = ir.Node("", "Attention", list(old.inputs), attrs, num_outputs=4, name=old.name, version=old.version)
        for src, dst in zip(old.outputs, new.outputs):
            dst.name, dst.shape, dst.type = src.name, src.shape, src.type
        probs = new.outputs[3]
        probs.name = namer(f"h2o_probs_{i}")
        probs.type = new.outputs[0].type
        kept = range(min(3, len(old.outputs)))          # Y (and present K/V, where the op has them)
        ir.convenience.replace_nodes_and_values(graph, old, [old], [new], [old.outputs[j] for j in kept],
                                                [new.outputs[j] for j in kept])
        reduce = ir.Node("", "ReduceSum", [probs, axes], [ir.AttrInt64("keepdims", 0)], num_outputs=1,
                         name=namer(f"h2o_scores_{i}"))
        graph.insert_after(new, reduce)
        out = reduce.outputs[0]
        out.name, out.type = f"{io_names.ATTENTION_SCORES}{i}", probs.type
        out.shape = ir.Shape(["batch", None, None])                           # [B, H, C]
        graph.outputs.append(out)
    layout = json.loads(model.metadata_props.get(KV_LAYOUT_KEY, "") or "{}")  # kv_ring's
    model.metadata_props[KV_LAYOUT_KEY] = json.dumps({**layout, "type": "ring", "policy": "h2o"})
    return PassResult({"layers": len(attention)})
