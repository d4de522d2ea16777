"""Where a per-channel scale can be folded exactly: X -> X / s upstream, W -> diag(s) W downstream.

Three kinds of site, each a `Rule` plus a little grouping over the value's uses:

  norm     h ─ RMSNorm/LayerNorm(γ, β) ─┬─ [Reshape] ─ q/k/v (or gate/up, c_attn, fc) linears
           γ, β ÷ s                      └─ ...            every consumer: W rows × s

  attn_v   x ─ v_proj ─ Reshape ─ Transpose ─ Concat(past) ─ [Unsqueeze─Expand─Reshape: GQA]
           W_v cols (and bias) ÷ s       ─ Attention(q, k, ·) ─ Transpose ─ Reshape ─ o_proj
                                                             o_proj rows × s (repeated per group)
           Attention is linear in V, so this is exact; the V cache then holds V / s, which is
           consistent because the engine only ever reads back what it wrote.

  mlp_up   x ─ up_proj ─┐                       SwiGLU is linear in `up`:
           act(gate) ───┴─ Mul ─ down_proj       W_up cols (and bias) ÷ s, W_down rows × s

A linear whose input comes from anything else (GELU, a fused qkv Split, the final norm feeding the
lm_head when that stays high precision) is reported with the reason it has no site.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from enginesmith.passes.machinery import match
from enginesmith.passes.analysis.linears import Linear, find_linears, select
from enginesmith.passes.machinery.match import Match, Rejection, Rule


@dataclass
class Site:
    kind: str                     # "norm" | "attn_v" | "mlp_up"
    name: str
    consumers: list[Linear]       # all read the scaled activation (rows × s)
    divide: list[tuple[ir.Node, int, int]]  # (node, input index, channel axis): that constant ÷ s
    channels: int                 # len(s)
    expand: np.ndarray | None     # consumer input channel -> site channel (GQA); None = identity

    def consumer_scale(self, s: np.ndarray) -> np.ndarray:
        """`s` over the consumers' K channels."""
        return s if self.expand is None else s[self.expand]

    def pool(self, per_k: np.ndarray, how=np.maximum) -> np.ndarray:
        """Reduce a per-consumer-channel statistic onto the site's channels (max or mean)."""
        if self.expand is None:
            return per_k
        if how is np.mean:
            return np.bincount(self.expand, weights=per_k, minlength=self.channels) / \
                np.bincount(self.expand, minlength=self.channels)
        out = np.full(self.channels, -np.inf, dtype=np.float64)
        np.maximum.at(out, self.expand, per_k)
        return out

    @property
    def act_names(self) -> list[str]:
        return sorted({lin.x.name for lin in self.consumers})

    def to_json(self) -> dict:
        return {"kind": self.kind, "site": self.name, "channels": self.channels,
                "consumers": [lin.name for lin in self.consumers]}


class NormRule(Rule):
    def __init__(self, layer_norm: bool):
        self.layer_norm = layer_norm
        self.name = "LayerNormalization" if layer_norm else "RMSNormalization"

    def pattern(self, op, h, gamma, beta):
        if self.layer_norm:
            return op.LayerNormalization(h, gamma, beta, _allow_other_attributes=True)
        return op.RMSNormalization(h, gamma, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        if match.constant(m["gamma"]) is None:
            return "scale (gamma) is not a constant"
        if m["beta"] is not None and match.constant(m["beta"]) is None:
            return "bias (beta) is not a constant"
        rank = m["h"].shape.rank() if m["h"].shape is not None else None
        axis = match.attr(m.root, "axis", -1)
        if axis != -1 and (rank is None or axis != rank - 1):
            return f"normalizes over axis {axis}, not the last one"
        if len(m.root.outputs) > 1 and any(o.uses() for o in m.root.outputs[1:]):
            return "its mean/inv-std outputs are used"
        return None


class AttnVRule(Rule):
    """Root: the Reshape that makes o_proj's input from the attention output."""

    def __init__(self, gqa: bool, v_bias: bool):
        self.gqa, self.v_bias = gqa, v_bias
        self.name = "attn_v" + ("+gqa" if gqa else "") + ("+bias" if v_bias else "")

    def pattern(self, op, xv, wv, bv, past, q, k):
        v = op.MatMul(xv, wv)
        if self.v_bias:
            v = op.Add(v, bv)
        vt = op.Transpose(op.Reshape(v, _allow_other_inputs=True, _allow_other_attributes=True),
                          perm=[0, 2, 1, 3])
        vv = op.Concat(past, vt, _allow_other_attributes=True, _outputs=["present"])
        if self.gqa:
            vv = op.Reshape(op.Expand(op.Unsqueeze(vv, _allow_other_inputs=True), _allow_other_inputs=True),
                            _allow_other_inputs=True, _allow_other_attributes=True)
        a = op.Attention(q, k, vv, _allow_other_inputs=True, _allow_other_attributes=True)
        return op.Reshape(op.Transpose(a, perm=[0, 2, 1, 3]), _allow_other_inputs=True,
                          _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        if match.constant(m["wv"]) is None or len(m["wv"].shape) != 2:
            return "v projection weight is not a constant matrix"
        if self.v_bias and match.constant(m["bv"]) is None:
            return "v bias is not a constant"
        concat = m["present"].producer()
        if match.attr(concat, "axis") not in (-2, 2):
            return "KV concat is not along the sequence axis"
        if self.gqa:
            unsqueeze = next(n for n in m.nodes if n.op_type == "Unsqueeze")
            if match.int_list(unsqueeze.inputs[1]) != [2]:
                return "GQA repeat does not insert the group axis at 2"
        head_dim = m["past"].shape[-1] if m["past"].shape is not None else None
        if not isinstance(head_dim, int):
            return "head dim of the V cache is not static"
        return match.private_interior(m, allow_graph_outputs=True)


class SwiGLURule(Rule):
    """Root: Mul(act(gate), up) (or Mul(up, act(gate))) whose output feeds down_proj."""

    def __init__(self, up_first: bool, up_bias: bool):
        self.up_first, self.up_bias = up_first, up_bias
        self.name = "mlp_up" + ("+bias" if up_bias else "") + (" (up first)" if up_first else "")

    def pattern(self, op, xu, wu, bu, gate):
        up = op.MatMul(xu, wu)
        if self.up_bias:
            up = op.Add(up, bu)
        return op.Mul(up, gate) if self.up_first else op.Mul(gate, up)

    def check(self, m: Match) -> str | None:
        if match.constant(m["wu"]) is None or len(m["wu"].shape) != 2:
            return "up projection weight is not a constant matrix"
        if self.up_bias and match.constant(m["bu"]) is None:
            return "up bias is not a constant"
        if match.constant(m["gate"]) is not None:
            return "the other Mul operand is a constant"
        return match.private_interior(m)


NORM_RULES = [NormRule(False), NormRule(True)]
ATTN_V_RULES = [AttnVRule(g, b) for g in (True, False) for b in (False, True)]
SWIGLU_RULES = [SwiGLURule(f, b) for f in (False, True) for b in (False, True)]


def _readers(value: ir.Value, lin_by_node: dict[int, Linear], channels: int | None) -> list[Linear] | str:
    """The linears reading `value` as their activation (directly or through a Reshape that keeps
    the last axis), or the reason some other node reads it."""
    if value.is_graph_output():
        return f"{value.name} is a graph output"
    out = []
    for use in value.uses():
        node = use.node
        lin = lin_by_node.get(id(node))
        if lin is not None and lin.x is value:
            out.append(lin)
            continue
        shape = match.int_list(node.inputs[1]) if node.op_type == "Reshape" and use.idx == 0 else None
        if shape and channels is not None and shape[-1] == channels:
            inner = _readers(node.outputs[0], lin_by_node, channels)
            if isinstance(inner, str):
                return inner
            out += inner
            continue
        return f"also read by {node.op_type} {node.name}"
    return out


def find_sites(model: ir.Model, linears: list[Linear], chosen: list[Linear]
               ) -> tuple[list[Site], list[Rejection]]:
    """Every foldable site whose consumers are all `chosen` linears (a subset of the graph's
    `linears`), and the chosen linears that no site scales, each with its reason."""
    lin_by_node = {id(lin.node): lin for lin in linears}
    chosen_ids = {id(lin.node) for lin in chosen}
    sites, rejected = [], []

    def accept(kind: str, m: Match, readers, channels: int) -> list[Linear] | None:
        if isinstance(readers, str) or not readers:
            rejected.append(Rejection(kind, m.root.name, readers or "feeds no linear", m.root))
            return None
        kept_high = [lin for lin in readers if id(lin.node) not in chosen_ids]
        if kept_high:
            rejected.append(Rejection(kind, m.root.name, f"it also feeds {kept_high[0].name}, "
                                      "which stays high precision", m.root))
            return None
        return readers

    norms, rejects = match.find_all(model, NORM_RULES)
    rejected += rejects
    for m in norms:
        channels = int(m["gamma"].shape[0])
        readers = accept("norm", m, _readers(m.root.outputs[0], lin_by_node, channels), channels)
        if readers is None:
            continue
        divide = [(m.root, _index(m.root, m["gamma"]), 0)]
        if m["beta"] is not None:
            divide.append((m.root, _index(m.root, m["beta"]), 0))
        sites.append(Site("norm", f"{m.root.name} -> {', '.join(r.name for r in readers)}",
                          readers, divide, channels, None))

    for kind, rules, w, b in (("attn_v", ATTN_V_RULES, "wv", "bv"), ("mlp_up", SWIGLU_RULES, "wu", "bu")):
        found, rejects = match.find_all(model, rules)
        rejected += rejects
        for m in found:
            producer = next(n for n in m.nodes if n.op_type == "MatMul")
            channels = int(m[w].shape[1])
            readers = accept(kind, m, _readers(m.root.outputs[0], lin_by_node, None), channels)
            if readers is None:
                continue
            if len(readers) != 1:
                rejected.append(Rejection(kind, m.root.name, "feeds more than one linear", m.root))
                continue
            consumer, expand = readers[0], None
            if consumer.k != channels:
                head_dim = int(m["past"].shape[-1]) if kind == "attn_v" else 0
                if not head_dim or consumer.k % channels or channels % head_dim:
                    rejected.append(Rejection(kind, m.root.name, f"{consumer.name} has K={consumer.k}"
                                              f" but the producer has {channels} channels", m.root))
                    continue
                rep = consumer.k // channels  # q heads per kv head; head h reads kv head h // rep
                k = np.arange(consumer.k)
                expand = (k // head_dim // rep) * head_dim + k % head_dim
            divide = [(producer, _index(producer, m[w]), 1)]
            if m[b] is not None:
                add = next(n for n in m.nodes if n.op_type == "Add")
                divide.append((add, _index(add, m[b]), len(m[b].shape) - 1))
            sites.append(Site(kind, f"{producer.name} -> {consumer.name}", [consumer], divide,
                              channels, expand))
    return sites, _why_not(chosen, sites, rejected)


def _index(node: ir.Node, value: ir.Value) -> int:
    return next(i for i, v in enumerate(node.inputs) if v is value)


def _why_not(chosen: list[Linear], sites: list[Site], rejected: list[Rejection]) -> list[Rejection]:
    """One entry per chosen linear that no site scales, with the most specific reason known."""
    covered = {id(lin.node) for site in sites for lin in site.consumers}
    by_root = {id(r.root): r.reason for r in rejected}
    out = []
    for lin in chosen:
        if id(lin.node) in covered:
            continue
        producer = lin.x.producer()
        while producer is not None and producer.op_type == "Reshape" and id(producer) not in by_root:
            producer = producer.inputs[0].producer()
        if producer is None:
            reason = "its input is a graph input"
        elif id(producer) in by_root:
            reason = f"{producer.op_type} {producer.name}: {by_root[id(producer)]}"
        else:
            reason = (f"its input comes from {producer.op_type} {producer.name}, which cannot absorb "
                      "a per-channel scale exactly")
        out.append(Rejection("site", lin.name, reason, lin.node))
    return out


def plan(model: ir.Model, include_lm_head: bool, through_v: bool, through_up: bool
         ) -> tuple[list[Site], list[Rejection]]:
    """The sites a smoothing pass (SmoothQuant, AWQ) will scale, and every chosen linear it will
    not, with the reason (kinds switched off by the pass's parameters included)."""
    linears, _ = find_linears(model)
    chosen, skipped = select(linears, include_lm_head)
    sites, why = find_sites(model, linears, chosen)
    off = {"attn_v": "through_v=false", "mlp_up": "through_up=false"}
    enabled = {"norm": True, "attn_v": through_v, "mlp_up": through_up}
    kept = []
    for site in sites:
        if enabled[site.kind]:
            kept.append(site)
        else:
            why += [Rejection("site", lin.name, f"{site.kind} smoothing is off ({off[site.kind]})",
                              lin.node) for lin in site.consumers]
    return kept, skipped + why
