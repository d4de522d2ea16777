"""PyTorch references (the oracles of the plugin tests) for the kernels in plugins/.

Dimension legend: B sequences, Sq query tokens, H query heads, Hkv KV heads, G = H // Hkv,
D head size, BS page size, NB pages, MB pages per sequence, T new tokens.
"""

from __future__ import annotations

import math

import torch


def paged_attention(query, k_cache, v_cache, block_tables, context_lens, scale: float | None = None):
    """Causal attention of the Sq new tokens over each sequence's pages; float32 [B, Sq, H, D].

    query [B, Sq, H, D]; k_cache/v_cache [NB, BS, Hkv, D]; block_tables [B, MB]; context_lens [B]
    (tokens in the cache, the Sq new ones included). Query token s sits at position ctx - Sq + s.
    """
    B, Sq, H, D = query.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if not scale else scale
    out = torch.empty(B, Sq, H, D, dtype=torch.float32, device=query.device)
    for b in range(B):
        ctx = int(context_lens[b])
        pages = block_tables[b, : (ctx + BS - 1) // BS].long()
        k = k_cache[pages].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(G, dim=1)  # [ctx, H, D]
        v = v_cache[pages].reshape(-1, Hkv, D)[:ctx].float().repeat_interleave(G, dim=1)
        q = query[b].float()  # [Sq, H, D]
        scores = torch.einsum("shd,thd->hst", q, k) * scale  # [H, Sq, ctx]
        pos = torch.arange(ctx, device=query.device)
        limit = ctx - Sq + torch.arange(Sq, device=query.device)  # last visible position per query token
        scores = scores.masked_fill(pos[None, None, :] > limit[None, :, None], float("-inf"))
        out[b] = torch.einsum("hst,thd->shd", scores.softmax(dim=-1), v)
    return out


def write_kv(key, value, slot_mapping, k_cache, v_cache) -> None:
    """In place: cache[slot // BS, slot % BS] = new token's [Hkv, D]; slot -1 is skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(-1, *k_cache.shape[2:])[slots] = key[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slots] = value[keep]


def prune_24_magnitude(weight: torch.Tensor) -> torch.Tensor:
    """Keep the 2 largest-magnitude values of every aligned group of 4 along the last dim."""
    N, K = weight.shape
    groups = weight.reshape(N, K // 4, 4)
    keep = groups.abs().float().topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return (groups * mask).reshape(N, K)


def is_24_sparse(weight: torch.Tensor) -> bool:
    N, K = weight.shape
    return bool(((weight.reshape(N, K // 4, 4) != 0).sum(-1) <= 2).all())


def make_paged_cache(batch, context_lens, num_kv_heads, head_size, block_size, dtype, device, spare_pages=3, generator=None):
    """Random caches with the sequences' pages shuffled through the pool.

    Returns (k_cache, v_cache, block_tables [B, MB] int32, context_lens int32); unused table slots
    hold -1 (never read by a correct kernel).
    """
    pages_per_seq = [(c + block_size - 1) // block_size for c in context_lens]
    mb = max(pages_per_seq)
    nb = sum(pages_per_seq) + spare_pages
    k_cache = torch.randn(nb, block_size, num_kv_heads, head_size, generator=generator, device="cpu").to(dtype).to(device)
    v_cache = torch.randn(nb, block_size, num_kv_heads, head_size, generator=generator, device="cpu").to(dtype).to(device)
    perm = torch.randperm(nb, generator=generator)
    tables = torch.full((batch, mb), -1, dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages_per_seq):
        tables[b, :n] = perm[i : i + n].to(torch.int32)
        i += n
    return k_cache, v_cache, tables.to(device), torch.tensor(context_lens, dtype=torch.int32, device=device)
