"""PyTorch and numpy references (the oracles of the plugin tests) for the kernels in plugins/.

Dimension legend: B sequences, Sq (S) query tokens, H query heads, Hkv KV heads, G = H // Hkv,
D head size, BS page size, NB pages, MB pages per sequence, T new tokens, P rotary positions.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _rotate_half_split(x, cos, sin):
    """GroupQueryAttention's rotary (half-split pairs x[i], x[i + D/2]) of fp16 x [..., D] with fp16
    cos/sin [..., D/2] broadcast against it, in fp32, rounded to fp16 (what goes into the cache)."""
    half = x.shape[-1] // 2
    c, s = cos.astype(np.float32), sin.astype(np.float32)
    x1, x2 = x[..., :half].astype(np.float32), x[..., half:].astype(np.float32)
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float16)


def attention_mask(query_pos, key_pos, window: int = -1):
    """Keys each query sees [n, t] (bool): causal, and with a window W > 0 only the last W positions,
    itself included (key > query - W: transformers' sliding_window, com.microsoft.GroupQueryAttention's
    local_window_size since ONNX Runtime 1.23)."""
    query_pos, key_pos = np.asarray(query_pos)[:, None], np.asarray(key_pos)[None, :]
    seen = key_pos <= query_pos
    return seen & (key_pos > query_pos - window) if window > 0 else seen


def softcap_scores(scores, softcap: float = 0.0):
    """Gemma 2's attention soft-capping of scaled scores: softcap * tanh(scores / softcap); 0 = off."""
    return softcap * np.tanh(scores / softcap) if softcap > 0 else scores


def group_query_attention(qkv, past_key, past_value, seqlens_k, cos_cache, sin_cache, num_heads: int,
                          kv_num_heads: int, scale: float, softcap: float = 0.0, local_window_size: int = -1,
                          kv_scale=None):
    """numpy reference of com.enginesmith.GroupQueryAttention (plugins/ort_ops/attention.h), which has
    com.microsoft.GroupQueryAttention's semantics with do_rotary=1, packed QKV and a shared buffer.

    qkv [B, S, (H + 2 Hkv) D] fp16; past_key/past_value [B, Hkv, C, D] fp16, or int8 / uint8 (fp8 e4m3)
    codes with kv_scale [2, Hkv, D] float32 (K's, V's channel scales: kv_encode on the write, kv_decode
    on the read, so a token attends to the decoded values of the new K/V too; the paged op's rule);
    seqlens_k [B] int32 (tokens in row b after this step, minus 1); cos_cache/sin_cache [P, D/2] fp16.
    Row b's token s sits at p = seqlens_k[b] + 1 - S + s; q and k are rotated there (fp16), the new K/V
    go to the cache, and the token attends to attention_mask(p, keys, local_window_size) with
    soft-capped fp32 scores. Returns (out [B, S, H D] fp16, present_key, present_value): new arrays. A
    row whose length leaves [S, C] or the rotary tables gets NaN outputs and an untouched cache.
    """
    B, S, width = qkv.shape
    H, Hkv = num_heads, kv_num_heads
    D = width // (H + 2 * Hkv)
    G, C, P = H // Hkv, past_key.shape[2], cos_cache.shape[0]
    heads = qkv.reshape(B, S, H + 2 * Hkv, D)
    k_cache, v_cache = past_key.copy(), past_value.copy()
    quantized = past_key.dtype != np.float16
    if quantized:
        assert kv_scale is not None and kv_scale.shape == (2, Hkv, D), "quantized caches need kv_scale [2, Hkv, D]"

    def store(x, which):  # x [t, Hkv, D] fp16 -> the cache's elements [Hkv, t, D]
        return (kv_encode(x, kv_scale[which], past_key.dtype) if quantized else x).transpose(1, 0, 2)

    def load(c, which):  # the cache's elements [Hkv, t, D] -> values, float32
        if not quantized:
            return c.astype(np.float32)
        return kv_decode(c.transpose(1, 0, 2), kv_scale[which]).transpose(1, 0, 2)

    out = np.full((B, S, H, D), np.nan, np.float16)
    for b in range(B):
        total = int(seqlens_k[b]) + 1
        past = total - S
        if past < 0 or total > C or total > P:
            continue
        pos = past + np.arange(S)
        cos, sin = cos_cache[pos][:, None, :], sin_cache[pos][:, None, :]
        k_cache[b, :, past:total] = store(_rotate_half_split(heads[b, :, H:H + Hkv], cos, sin), 0)
        v_cache[b, :, past:total] = store(heads[b, :, H + Hkv:], 1)
        q = _rotate_half_split(heads[b, :, :H], cos, sin).astype(np.float32)  # [S, H, D]
        k = np.repeat(load(k_cache[b, :, :total], 0), G, axis=0)  # [H, total, D]
        v = np.repeat(load(v_cache[b, :, :total], 1), G, axis=0)
        scores = softcap_scores(np.einsum("shd,htd->hst", q, k) * np.float32(scale), softcap)
        scores = np.where(attention_mask(pos, np.arange(total), local_window_size)[None], scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[b] = (np.einsum("hst,htd->shd", w, v) / w.sum(-1).T[..., None]).astype(np.float16)
    return out.reshape(B, S, H * D), k_cache, v_cache


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


def kv_encode(x, scale, dtype):
    """Codes of values x [..., Hkv, D] under channel scales [Hkv, D] (plugins/paged_attention/kv_quant.h):
    dtype int8: clip(rint(x / scale), -127, 127); uint8: the fp8 e4m3 bytes of x / scale, rounded to
    nearest even and saturated to +-448. x / scale in float32 (IEEE), as the kernels compute it."""
    v = np.asarray(x, np.float32) / np.asarray(scale, np.float32)
    if np.dtype(dtype) == np.int8:
        return np.clip(np.rint(v), -127, 127).astype(np.int8)
    return torch.from_numpy(np.ascontiguousarray(v)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()


def kv_decode(codes, scale):
    """Values (float32) of codes [..., Hkv, D] (int8, or uint8 fp8 e4m3 bytes) under scales [Hkv, D]."""
    if codes.dtype == np.int8:
        wide = codes.astype(np.float32)
    else:
        wide = torch.from_numpy(np.ascontiguousarray(codes)).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    return wide * np.asarray(scale, np.float32)


def paged_group_query_attention(qkv, key_pool, value_pool, block_tables, context_lens, slot_mapping, cos_cache,
                                sin_cache, num_heads: int, kv_num_heads: int, scale: float = 0.0, kv_scale=None,
                                softcap: float = 0.0, local_window_size: int = -1):
    """numpy reference of com.enginesmith.PagedGroupQueryAttention (plugins/ort_ops/paged_gqa.h).

    qkv [B, S, (H + 2 Hkv) D] fp16; key_pool/value_pool [NB, BS, Hkv, D] fp16, or int8 / uint8 (fp8
    e4m3) codes with kv_scale [2, Hkv, D] float32 (K's, V's channel scales: kv_encode on the write,
    kv_decode on the read, so a column attends to the decoded values of its own new K/V too); block_tables [B, MB],
    context_lens [B], slot_mapping [B, S] int32 (-1: a padding column); cos_cache/sin_cache [P, D/2]
    fp16. Column s of row b sits at p = context_lens[b] - S + s; q and k are rotated there (half-split,
    rounded to fp16), the new K/V go to their slots, and the column attends to attention_mask(p, keys,
    local_window_size) with soft-capped fp32 scores (softcap_scores). With a window W the row's pages
    are read from the one holding p0 - W + 1 (p0: its first column's position) on.
    Returns (out [B, S, H D] fp16, key_pool, value_pool): new arrays, the inputs are left as they are.
    Padding columns get zeros. Bad data gives the row NaN: a length outside [S, MB BS] or a real column
    beyond the rotary tables (nothing of the row written), a page index outside [0, NB) at a position
    < context_lens[b] in the pages read, or a slot that is not its position's (that slot not written).
    """
    B, S, width = qkv.shape
    H, Hkv = num_heads, kv_num_heads
    D = width // (H + 2 * Hkv)
    half, G = D // 2, H // Hkv
    NB, BS = key_pool.shape[:2]
    MB, P = block_tables.shape[1], cos_cache.shape[0]
    scale = np.float32(scale or 1.0 / math.sqrt(D))
    k_pool, v_pool = key_pool.copy(), value_pool.copy()
    k_slots, v_slots = k_pool.reshape(NB * BS, Hkv, D), v_pool.reshape(NB * BS, Hkv, D)  # views
    quantized = key_pool.dtype != np.float16
    if quantized:
        assert kv_scale is not None and kv_scale.shape == (2, Hkv, D), "quantized pools need kv_scale [2, Hkv, D]"
    store = (lambda x, which: kv_encode(x, kv_scale[which], key_pool.dtype)) if quantized else (lambda x, which: x)
    load = (lambda c, which: kv_decode(c, kv_scale[which])) if quantized else (lambda c, which: c.astype(np.float32))
    heads = qkv.reshape(B, S, H + 2 * Hkv, D)
    out = np.zeros((B, S, H, D), np.float16)

    def rotate(x, pos):  # x [n, heads, D] fp16 at positions pos [n] -> fp16
        c = cos_cache[pos].astype(np.float32)[:, None, :]
        s = sin_cache[pos].astype(np.float32)[:, None, :]
        x1, x2 = x[..., :half].astype(np.float32), x[..., half:].astype(np.float32)
        return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(np.float16)

    for b in range(B):
        ctx, slots, table = int(context_lens[b]), slot_mapping[b].astype(np.int64), block_tables[b].astype(np.int64)
        pos = ctx - S + np.arange(S)
        real = slots != -1
        if ctx < S or ctx > MB * BS or (real & (pos >= P)).any():
            out[b] = np.nan
            continue
        mine = table[pos // BS] * BS + pos % BS
        good = real & (slots >= 0) & (slots < NB * BS) & (slots == mine)
        k_slots[slots[good]] = store(rotate(heads[b, good, H:H + Hkv], pos[good]), 0)
        v_slots[slots[good]] = store(heads[b, good, H + Hkv:], 1)
        first_page = max(0, ctx - S - local_window_size + 1) // BS if local_window_size > 0 else 0
        pages = table[first_page: (ctx + BS - 1) // BS]
        if (real & ~good).any() or ((pages < 0) | (pages >= NB)).any():
            out[b] = np.nan
            continue
        cached = np.arange(first_page * BS, ctx)
        at = table[cached // BS] * BS + cached % BS
        k = np.repeat(load(k_slots[at], 0), G, axis=1)  # [ctx, H, D]
        v = np.repeat(load(v_slots[at], 1), G, axis=1)
        q = rotate(heads[b, real, :H], pos[real]).astype(np.float32)  # [n, H, D]
        scores = softcap_scores(np.einsum("nhd,thd->nht", q, k) * scale, softcap)
        scores = np.where(attention_mask(pos[real], cached, local_window_size)[:, None, :], scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        out[b, real] = (np.einsum("nht,thd->nhd", w, v) / w.sum(-1)[..., None]).astype(np.float16)
    return out.reshape(B, S, H * D), k_pool, v_pool


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
