"""The one rule of the KV-layout rewrites (kv_ring, kv_paged): a layer of the exported dense KV cache.

Dimension legend: B batch, H query heads, Hkv key/value heads, S new tokens, P past tokens, D head size.

    k_new ─ [RotaryEmbedding ─ k_rot] ─ Concat(past_k [B,Hkv,P,D]) ─ present_k ─ [GQA repeat] ─┐
    v_new ───────────────────────────── Concat(past_v) ───────────── present_v ─ [GQA repeat] ─┤
    q ────────────────────────────────────────────────────────────────────────────── Attention ─ y

Variants are constructor switches: `gqa` (the exporter's K/V repeat before the Attention) and
`rotary_keys` (the new keys pass through a RotaryEmbedding inside the match: kv_ring stores keys
unrotated and rotates the cache instead). What each rewrite needs beyond the dense structure is data
too: `plain_softmax` names the Attention attributes that must keep their defaults (with the reason
reported otherwise) and `static_heads` asks for a static query shape whose heads are a multiple of
the KV heads (kv_paged writes them into the op's attributes).
"""

from __future__ import annotations

from enginesmith.core import io_names
from enginesmith.passes.fusion.fuse_attention import dense_kv_reason
from enginesmith.passes.machinery import match
from enginesmith.passes.machinery.match import Match, Rule, gqa_repeat

# Attention attributes a rewrite may require at their defaults: (name, default).
ATTENTION_DEFAULTS = {"is_causal": 0, "softcap": 0.0, "qk_matmul_output_mode": 0}


class DenseKVAttention(Rule):
    """Root: a layer's Attention whose K/V are Concat(past input, new) [+ GQA repeat]."""

    def __init__(self, gqa: bool, rotary_keys: bool = False, plain_softmax: tuple[str, ...] = (),
                 static_heads: bool = False, why_plain: str = "not supported by this rewrite"):
        self.gqa, self.rotary_keys = gqa, rotary_keys
        self.plain_softmax, self.static_heads, self.why_plain = plain_softmax, static_heads, why_plain
        self.name = "dense_kv_attention" + ("+gqa" if gqa else "")

    def pattern(self, op, q, past_k, k_new, past_v, v_new):
        k_in = k_new
        if self.rotary_keys:
            k_in = op.RotaryEmbedding(k_new, _allow_other_inputs=True, _allow_other_attributes=True,
                                      _outputs=["k_rot"])
        k = op.Concat(past_k, k_in, _allow_other_attributes=True, _outputs=["present_k"])
        v = op.Concat(past_v, v_new, _allow_other_attributes=True, _outputs=["present_v"])
        if self.gqa:
            k, v = gqa_repeat(op, k), gqa_repeat(op, v)
        return op.Attention(q, k, v, _allow_other_inputs=True, _allow_other_attributes=True)

    def check(self, m: Match) -> str | None:
        att = m.root
        reason = dense_kv_reason(m, self.gqa)
        if reason:
            return reason
        if self.static_heads:
            q = m["q"]
            if q.shape is None or len(q.shape) != 4 or not isinstance(q.shape[1], int):
                return "query has no static [B, H, S, D] shape"
            if q.shape[1] % m["past_k"].shape[1]:
                return f"{q.shape[1]} query heads are not a multiple of {m['past_k'].shape[1]} KV heads"
        for name in self.plain_softmax:
            default = ATTENTION_DEFAULTS[name]
            if match.attr(att, name, default) != default:
                return f"Attention has {name}={match.attr(att, name)} ({self.why_plain})"
        if self.rotary_keys and len(m["k_rot"].uses()) != 1:
            return "the rotated new keys are used outside the cache"
        return None


def layer_index(m: Match, fallback: int) -> int:
    """The layer a match belongs to, read from its past input's name (past_key_values.{i}.key), else
    `fallback` (its order among the matches)."""
    layer = io_names.layer_of(m["past_k"].name)
    return fallback if layer is None else layer


def dense_kv_rules(**variant) -> list[DenseKVAttention]:
    """Both GQA variants of the rule (with and without the repeat), for `match.find_all`."""
    return [DenseKVAttention(True, **variant), DenseKVAttention(False, **variant)]


__all__ = ["ATTENTION_DEFAULTS", "DenseKVAttention", "dense_kv_rules", "layer_index"]
