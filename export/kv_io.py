"""A module whose forward takes and returns the KV cache as plain tensors, ready to export.

    inputs   input_ids        [B, S]        int64
             attention_mask   [B, P+S]      int64  1 = real token, 0 = left padding
             position_ids     [B, S]        int64
             past_key_values.{i}.key/value  [B, Hkv, P, D]
    outputs  logits           [B, S, V]     float
             present.{i}.key/value          [B, Hkv, P+S, D]

The names, in order, are core/io_names.py's input_names / output_names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from enginesmith.export import adapter


@dataclass(frozen=True)
class KVShape:
    layers: int
    kv_heads: int
    head_dim: int
    heads: int
    vocab: int
    max_positions: int

    @classmethod
    def of(cls, config) -> "KVShape":
        heads = getattr(config, "num_attention_heads", None) or config.n_head
        hidden = getattr(config, "hidden_size", None) or config.n_embd
        layers = getattr(config, "num_hidden_layers", None) or config.n_layer
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        max_pos = getattr(config, "max_position_embeddings", None) or config.n_positions
        return cls(layers, kv_heads, head_dim, heads, config.vocab_size, max_pos)


class KVCacheIO(torch.nn.Module):
    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.layers = KVShape.of(model.config).layers

    def forward(self, input_ids, attention_mask, position_ids, *past):
        pairs = [(past[2 * i], past[2 * i + 1]) for i in range(self.layers)]
        cache = adapter.make_cache(self.model.config, pairs, keep_all=True)
        out = adapter.forward(self.model, input_ids, attention_mask, position_ids, cache)
        flat = [out.logits]
        for k, v in adapter.cache_tensors(adapter.output_cache(out)):
            flat += [k, v]
        return tuple(flat)
