"""Rotary embedding of cached keys at their positions in the cache (a helper of the kv_ring pass).

The dense graph rotates each new key once, with cos/sin computed from `position_ids`:

    position_ids ─ Unsqueeze ─ Cast ─ Mul(inv_freq) ─ Cos ─┐
                                                  └─ Sin ─┤
    k [B, Hkv, S, D] ──────────────────────── RotaryEmbedding ─ k_rot

The ring graph keeps keys unrotated and rotates the whole cache every step with `cache_positions`
[B, C]. `RopeCloner` rebuilds the cos/sin computation with `position_ids` replaced by another input
(the nodes that do not depend on it are shared, equal clones are made once), so any RoPE variant the
exporter wrote (scaling, attention factor) is reproduced, not re-derived. A RotaryEmbedding that
takes `position_ids` itself (cos/sin caches indexed by position) is given the new positions directly.
"""

from __future__ import annotations

import onnx_ir as ir

from enginesmith.passes.machinery.edit import Namer


def depends_on(value: ir.Value, source: ir.Value, memo: dict[int, bool]) -> bool:
    """True when `value` is computed from `source` (walks producers; memoized by value id)."""
    key = id(value)
    if key in memo:
        return memo[key]
    memo[key] = False  # cycles cannot occur in a valid graph; this only guards re-entry
    if value is source:
        memo[key] = True
        return True
    node = value.producer()
    found = node is not None and any(i is not None and depends_on(i, source, memo) for i in node.inputs)
    memo[key] = found
    return found


class RopeCloner:
    """Copies of computations with one graph input (`old`) replaced by another (`new`)."""

    def __init__(self, graph: ir.Graph, namer: Namer, old: ir.Value, new: ir.Value, suffix: str):
        self.graph, self.namer, self.old, self.new, self.suffix = graph, namer, old, new, suffix
        self._clones: dict[int, ir.Value] = {}
        self._by_structure: dict[tuple, ir.Node] = {}
        self._depends: dict[int, bool] = {}

    def __call__(self, value: ir.Value) -> ir.Value:
        """`value` recomputed from `new` instead of `old` (the value itself when independent)."""
        if value is self.old:
            return self.new
        if id(value) in self._clones:
            return self._clones[id(value)]
        if not depends_on(value, self.old, self._depends):
            return value
        node = value.producer()
        inputs = [self(i) if i is not None else None for i in node.inputs]
        key = (node.domain, node.op_type, tuple(id(i) for i in inputs),
               tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())))
        clone = self._by_structure.get(key)
        if clone is None:
            clone = ir.Node(node.domain, node.op_type, inputs,
                            attributes=[_copy_attr(a) for a in node.attributes.values()],
                            num_outputs=len(node.outputs), name=self.namer(f"{node.name or node.op_type}_{self.suffix}"))
            for src, dst in zip(node.outputs, clone.outputs):
                dst.name = self.namer(f"{src.name}_{self.suffix}")
                dst.type = src.type
            self.graph.append(clone)  # the caller sorts the graph afterwards
            self._by_structure[key] = clone
        for src, dst in zip(node.outputs, clone.outputs):
            self._clones[id(src)] = dst
        return self._clones[id(value)]


def _copy_attr(attr: ir.Attr) -> ir.Attr:
    return ir.Attr(attr.name, attr.type, attr.value)


def rotary_for_cache(graph: ir.Graph, namer: Namer, rope: ir.Node, keys: ir.Value,
                     positions: ir.Value, cloner: RopeCloner) -> ir.Value:
    """RotaryEmbedding of `keys` [B, Hkv, C, D] at `positions` [B, C], built like `rope` (the
    dense graph's RotaryEmbedding of new keys): same attributes, cos/sin recomputed for `positions`."""
    cos, sin = rope.inputs[1], rope.inputs[2]
    has_positions = len(rope.inputs) > 3 and rope.inputs[3] is not None
    if has_positions:  # cos/sin are caches indexed by position: index them with the cache positions
        inputs = [keys, cos, sin, positions]
    else:
        inputs = [keys, cloner(cos), cloner(sin)]
    node = ir.Node(rope.domain, "RotaryEmbedding", inputs,
                   attributes=[_copy_attr(a) for a in rope.attributes.values()], num_outputs=1,
                   name=namer(f"{rope.name or 'rope'}_cache"))
    out = node.outputs[0]
    out.name, out.type = namer(f"{keys.name}_rot"), keys.type
    graph.append(node)
    return out
