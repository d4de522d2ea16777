"""A small PyTorch reference of StreamingLLM's cache policy, the oracle of the ring KV tests.

It follows the MIT reference (mit-han-lab/streaming-llm): `StartRecentKVCache` keeps the first
`start` and the last `recent` entries and, before a forward of `n` new tokens, `evict_for_space(n)`
drops the oldest recent entries so that start + recent still holds after appending; the
"pos-shift" attention caches keys *before* RoPE and rotates them every step by their index in the
cache (`arange(kv_len)`), queries by theirs (kv_len - n + i). With start = sinks and recent = window
this is the policy the ring graph implements with fixed buffers.

Written against the Hugging Face Llama-style decoder modules (Llama, Qwen2, Mistral): embed,
per layer input_layernorm -> q/k/v_proj -> attention -> o_proj, post_attention_layernorm -> mlp,
final norm, lm_head. Batch 1, fp32, float64 softmax; no masking beyond causality within a chunk.
"""

from __future__ import annotations

import numpy as np
import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StartRecentReference:
    def __init__(self, model, start: int, recent: int):
        self.model, self.start, self.recent = model, start, recent
        self.keys: list[torch.Tensor | None] = [None] * model.config.num_hidden_layers    # pre-RoPE
        self.values: list[torch.Tensor | None] = [None] * model.config.num_hidden_layers

    def __len__(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def evict_for_space(self, num_coming: int) -> None:
        """MIT's StartRecentKVCache.evict_for_space: keep [0, start) and the last recent - n."""
        length = len(self)
        if length + num_coming <= self.start + self.recent:
            return
        keep_recent = self.recent - num_coming
        assert keep_recent >= 0, "a chunk larger than the recent window"

        def cut(t):
            return torch.cat([t[:, :, :self.start], t[:, :, length - keep_recent:length]], dim=2)

        self.keys = [cut(k) for k in self.keys]
        self.values = [cut(v) for v in self.values]

    def observe(self, probs: torch.Tensor) -> None:
        """Each layer's attention probabilities [1, H, n, total] (a hook for the H2O reference)."""

    @torch.no_grad()
    def forward(self, ids: np.ndarray) -> np.ndarray:
        """Logits [1, n, V] of the chunk `ids` [1, n] after evict_for_space(n)."""
        inner = self.model.model
        ids_t = torch.as_tensor(np.asarray(ids), dtype=torch.long)
        n = ids_t.shape[1]
        self.evict_for_space(n)
        h = inner.embed_tokens(ids_t)
        for i, layer in enumerate(inner.layers):
            att = layer.self_attn
            heads = self.model.config.num_attention_heads
            kv_heads = self.model.config.num_key_value_heads
            dim = att.head_dim
            x = layer.input_layernorm(h)
            q = att.q_proj(x).view(1, n, heads, dim).transpose(1, 2)
            k = att.k_proj(x).view(1, n, kv_heads, dim).transpose(1, 2)
            v = att.v_proj(x).view(1, n, kv_heads, dim).transpose(1, 2)
            keys = k if self.keys[i] is None else torch.cat([self.keys[i], k], dim=2)
            values = v if self.values[i] is None else torch.cat([self.values[i], v], dim=2)
            self.keys[i], self.values[i] = keys, values
            total = keys.shape[2]
            cos_k, sin_k = inner.rotary_emb(v, torch.arange(total)[None])            # [1, total, D]
            cos_q, sin_q = cos_k[:, total - n:], sin_k[:, total - n:]
            q = q * cos_q[:, None] + _rotate_half(q) * sin_q[:, None]
            keys = keys * cos_k[:, None] + _rotate_half(keys) * sin_k[:, None]
            groups = heads // kv_heads
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
            scores = (q.double() @ keys.double().transpose(2, 3)) * att.scaling        # [1, H, n, total]
            query_at = torch.arange(total - n, total)[:, None]
            scores = scores.masked_fill(torch.arange(total)[None, :] > query_at, float("-inf"))
            probs = scores.softmax(-1)
            self.observe(probs)
            out = (probs @ values.double()).float()
            out = out.transpose(1, 2).reshape(1, n, heads * dim)
            h = h + att.o_proj(out)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h)).float().numpy()
