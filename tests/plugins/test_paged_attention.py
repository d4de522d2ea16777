"""GPU: paged attention kernels (decode, multi-token causal, GQA, fp16/bf16, D 64/128, BS 16/32/64,
split-K) against the PyTorch reference, the slot-mapping KV write, and bad data on the device."""

from __future__ import annotations

import itertools
import math

import pytest

from plugin_modules import kernels, reference, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def _run_case(torch, dtype, head_size, block_size, heads, kv_heads, query_len, context_lens, num_splits, seed=0):
    g = torch.Generator().manual_seed(seed)
    B = len(context_lens)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(
        B, context_lens, kv_heads, head_size, block_size, dtype, "cuda", generator=g)
    q = torch.randn(B, query_len, heads, head_size, generator=g).to(dtype).cuda()
    out, flag = kernels.paged_attention(q, k_cache, v_cache, tables, ctx, num_splits=num_splits)
    ref = reference.paged_attention(q, k_cache, v_cache, tables, ctx)
    return (out.float() - ref).abs().max().item(), flag


CASES = list(itertools.product(
    ["float16", "bfloat16"],  # dtype
    [64, 128],                # D
    [16, 32, 64],             # BS
    [(8, 8), (8, 2), (9, 3)],  # (H, Hkv): MHA, GQA 4, GQA 3 (SmolLM2)
    [1, 5, 16],               # Sq
))


@pytest.mark.parametrize("dtype,head_size,block_size,heads,query_len", [(c[0], c[1], c[2], c[3], c[4]) for c in CASES])
def test_matches_reference(kernels_lib, dtype, head_size, block_size, heads, query_len):
    import torch

    h, hkv = heads
    contexts = [query_len, 37 + query_len, 300, 1000]  # shortest context: only the new tokens
    for splits in (1, 0, 7):  # one block, the launcher's choice, forced split-K
        err, flag = _run_case(torch, getattr(torch, dtype), head_size, block_size, h, hkv, query_len, contexts, splits)
        assert flag == 0
        assert err < TOL[dtype], f"splits={splits}: max error {err}"


def test_long_context_split_k(kernels_lib):
    import torch

    err, flag = _run_case(torch, torch.float16, 128, 16, 32, 8, 1, [32768], 0)
    assert flag == 0 and err < 2e-3, err


def test_write_kv_through_slot_mapping(kernels_lib):
    import torch

    NB, BS, Hkv, D, T = 10, 16, 2, 64, 24
    kc = torch.zeros(NB, BS, Hkv, D, dtype=torch.float16, device="cuda")
    vc = torch.zeros_like(kc)
    key = torch.randn(T, Hkv, D, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(NB * BS, device="cuda")[:T].to(torch.int32)
    slots[3] = -1  # padding token: skipped
    assert kernels.write_kv(key, value, slots, kc, vc) == 0
    rk, rv = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv(key, value, slots, rk, rv)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)

    bad = slots.clone()
    bad[0] = NB * BS  # one past the pool
    assert kernels.write_kv(key, value, bad, kc, vc) & 4


def test_block_table_out_of_range_poisons_output_and_flags(kernels_lib):
    import torch

    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(2, [100, 200], 2, 64, 16, torch.float16, "cuda", generator=g)
    q = torch.randn(2, 1, 8, 64, generator=g).half().cuda()
    tables[1, 3] = k_cache.shape[0] + 5  # page outside the pool
    for splits in (1, 4):
        out, flag = kernels.paged_attention(q, k_cache, v_cache, tables, ctx, num_splits=splits)
        assert flag & 1
        assert torch.isnan(out[1]).all(), "the bad sequence must not get a plausible answer"
        ref = reference.paged_attention(q[:1], k_cache, v_cache, tables[:1], ctx[:1])
        assert (out[0].float() - ref[0]).abs().max().item() < 2e-3, "other sequences are unaffected"


def test_context_longer_than_block_table_flags(kernels_lib):
    import torch

    g = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(1, [64], 2, 64, 16, torch.float16, "cuda", generator=g)
    q = torch.randn(1, 1, 4, 64, generator=g).half().cuda()
    ctx[0] = 65  # table has 4 pages of 16
    out, flag = kernels.paged_attention(q, k_cache, v_cache, tables, ctx)
    assert flag & 2 and torch.isnan(out).all()


def test_unsupported_head_size_is_an_error(kernels_lib):
    import torch

    q = torch.zeros(1, 1, 4, 96, dtype=torch.float16, device="cuda")
    kc = torch.zeros(4, 16, 2, 96, dtype=torch.float16, device="cuda")
    tables = torch.zeros(1, 4, dtype=torch.int32, device="cuda")
    ctx = torch.ones(1, dtype=torch.int32, device="cuda")
    with pytest.raises(kernels.KernelError, match="head size 96"):
        kernels.paged_attention(q, kc, kc, tables, ctx)


def test_scale_parameter(kernels_lib):
    import torch

    g = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(1, [90], 1, 64, 32, torch.float16, "cuda", generator=g)
    q = torch.randn(1, 2, 2, 64, generator=g).half().cuda()
    out, _ = kernels.paged_attention(q, k_cache, v_cache, tables, ctx, scale=0.05)
    ref = reference.paged_attention(q, k_cache, v_cache, tables, ctx, scale=0.05)
    assert (out.float() - ref).abs().max().item() < 2e-3
    assert not math.isclose(0.05, 1 / 8)
