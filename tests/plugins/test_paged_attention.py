"""GPU: paged attention kernels (decode, multi-token causal, GQA, fp16/bf16, D 64/128, BS 16/32/64,
split-K with both split merges: the last block of each (sequence, KV head) in one kernel, "single",
and the separate reduce kernel, "two") against the PyTorch reference, the split counters left zero
for the next call / CUDA graph replay, the slot-mapping KV write, and bad data on the device."""

from __future__ import annotations

import itertools
import math

import pytest

from plugin_modules import kernels, reference, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


REDUCE = ["single", "two"]


def _run_case(torch, dtype, head_size, block_size, heads, kv_heads, query_len, context_lens, num_splits, seed=0,
              reduce="auto", prefetch_past=False):
    g = torch.Generator().manual_seed(seed)
    B = len(context_lens)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(
        B, context_lens, kv_heads, head_size, block_size, dtype, "cuda", generator=g)
    q = torch.randn(B, query_len, heads, head_size, generator=g).to(dtype).cuda()
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, num_splits, reduce=reduce, prefetch_past=prefetch_past)
    out = op(q, k_cache, v_cache, tables, ctx)
    ref = reference.paged_attention(q, k_cache, v_cache, tables, ctx)
    assert int(op.counters.abs().sum().item()) == 0, "split counters must be left zero for the next call"
    return (out.float() - ref).abs().max().item(), int(op.error_flag.item())


CASES = list(itertools.product(
    ["float16", "bfloat16"],  # dtype
    [64, 128],                # D
    [16, 32, 64],             # BS
    [(8, 8), (8, 2), (9, 3)],  # (H, Hkv): MHA, GQA 4, GQA 3 (SmolLM2)
    [1, 5, 16],               # Sq
))


# Plus G 8 x Sq 16 = 128 rows: two 64-row blocks per KV head.
WIDE = [("bfloat16", 64, 32, (16, 2), 16), ("float16", 128, 16, (16, 2), 16)]


@pytest.mark.parametrize("prefetch_past", [False, True], ids=["wait-first", "prefetch-past"])
@pytest.mark.parametrize("reduce", REDUCE)
@pytest.mark.parametrize("dtype,head_size,block_size,heads,query_len", [(c[0], c[1], c[2], c[3], c[4]) for c in CASES] + WIDE)
def test_matches_reference(kernels_lib, dtype, head_size, block_size, heads, query_len, reduce, prefetch_past):
    import torch

    h, hkv = heads
    contexts = [query_len, 37 + query_len, 300, 1000]  # shortest context: only the new tokens
    # one block (no merge: run once), the launcher's choice, forced split-K
    for splits in (1, 0, 7) if reduce == "single" else (0, 7):
        err, flag = _run_case(torch, getattr(torch, dtype), head_size, block_size, h, hkv, query_len, contexts, splits,
                              reduce=reduce, prefetch_past=prefetch_past)
        assert flag == 0
        assert err < TOL[dtype], f"splits={splits} reduce={reduce}: max error {err}"


@pytest.mark.parametrize("reduce", REDUCE)
def test_long_context_split_k(kernels_lib, reduce):
    import torch

    err, flag = _run_case(torch, torch.float16, 128, 16, 32, 8, 1, [32768], 0, reduce=reduce)
    assert flag == 0 and err < 2e-3, err


@pytest.mark.parametrize("reduce", REDUCE)
@pytest.mark.parametrize("dtype,head_size", [("float16", 128), ("bfloat16", 64)])
def test_max_splits_many_row_blocks(kernels_lib, reduce, dtype, head_size):
    """kMaxSplits splits, 2 row blocks of 64 rows per KV head (G 8 x Sq 16 = 128 rows), a batch of
    unequal contexts (some splits empty): the largest merge the last block does."""
    import torch

    limits = kernels_lib.paged_attention_limits()
    err, flag = _run_case(torch, getattr(torch, dtype), head_size, 16, 16, 2, 16, [20000, 700, 16],
                          limits.max_splits, reduce=reduce)
    assert flag == 0 and err < TOL[dtype], err


def _decode_setup(torch, B=3, contexts=(1500, 4000, 333), seed=5):
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(
        B, list(contexts), 8, 128, 16, torch.float16, "cuda", generator=g)
    q = torch.randn(B, 1, 32, 128, generator=g).half().cuda()
    return q, k_cache, v_cache, tables, ctx


@pytest.mark.parametrize("dependent_launch", [None, False, True])
def test_single_and_two_kernel_merges_agree(kernels_lib, dependent_launch):
    """Both merges (and the dependent launch on or off) give the same answer up to fp rounding."""
    import torch

    q, k_cache, v_cache, tables, ctx = _decode_setup(torch)
    outs = {}
    for reduce in REDUCE:
        op = kernels.PagedAttention(q, k_cache, v_cache, tables, 9, reduce=reduce, dependent_launch=dependent_launch)
        outs[reduce] = op(q, k_cache, v_cache, tables, ctx)
        assert int(op.error_flag.item()) == 0
    ref = reference.paged_attention(q, k_cache, v_cache, tables, ctx)
    assert (outs["single"].float() - ref).abs().max().item() < 2e-3
    assert (outs["single"].float() - outs["two"].float()).abs().max().item() < 2e-3


def test_single_kernel_merge_is_deterministic_and_graph_safe(kernels_lib):
    """Repeated calls, eager and as CUDA graph replays without any memset, give bit-identical output
    (the merge sums in split order, whichever block came last) and leave the counters zero."""
    import torch

    q, k_cache, v_cache, tables, ctx = _decode_setup(torch)
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, 13, reduce="single")
    out = torch.empty_like(q)
    first = op(q, k_cache, v_cache, tables, ctx, out).clone()
    for _ in range(3):
        op(q, k_cache, v_cache, tables, ctx, out)
        assert torch.equal(out, first)
    assert int(op.counters.abs().sum().item()) == 0

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(q, k_cache, v_cache, tables, ctx, out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(4):  # back-to-back calls reuse the same counters and partials
            op(q, k_cache, v_cache, tables, ctx, out)
    for _ in range(3):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, first)
    assert int(op.counters.abs().sum().item()) == 0
    assert int(op.error_flag.item()) == 0


@pytest.mark.parametrize("splits", [31, 32, 33, 65])
def test_reduce_kernel_split_counts_around_its_chunks(kernels_lib, splits):
    """The reduce kernel loads 32 splits per round (4 warps x 8): counts on both sides of 32 and 64,
    with the last splits empty (a context shorter than the table)."""
    import torch

    for contexts in ([8192], [5000, 8192, 77]):
        err, flag = _run_case(torch, torch.float16, 128, 16, 32, 8, 1, contexts, splits, reduce="two")
        assert flag == 0 and err < 2e-3, (splits, contexts, err)
    err, flag = _run_case(torch, torch.bfloat16, 64, 32, 9, 3, 5, [3000, 40], splits, reduce="two")
    assert flag == 0 and err < TOL["bfloat16"], (splits, err)


@pytest.mark.parametrize("context", [1024, 8192, 16384, 32768, 20000])
def test_default_splits_leave_no_split_empty(kernels_lib, context):
    """The launcher's split count gives every split some tokens at the table's full length (whole
    64-token tiles per split), and the answer is right."""
    import torch

    block_size = 16
    op = kernels.PagedAttention(torch.zeros(1, 1, 32, 128, dtype=torch.float16, device="cuda"),
                                torch.zeros(1, block_size, 8, 128, dtype=torch.float16, device="cuda"),
                                torch.zeros(1, block_size, 8, 128, dtype=torch.float16, device="cuda"),
                                torch.zeros(1, (context + block_size - 1) // block_size, dtype=torch.int32,
                                            device="cuda"))
    tokens = (context + block_size - 1) // block_size * block_size
    per_split = math.ceil(math.ceil(tokens / op.splits) / 64) * 64  # the kernel's whole-tile split range
    assert (op.splits - 1) * per_split < tokens, (op.splits, per_split)
    err, flag = _run_case(torch, torch.float16, 128, block_size, 32, 8, 1, [context], 0, reduce="two")
    assert flag == 0 and err < 2e-3, err


def _check_graph_replays(torch, steps, outs, want, replays):
    """Capture steps() in a CUDA graph (after a warm-up on a side stream) and replay it: each replay,
    with the outputs poisoned with NaN first, must write outs[i] == want[i % 2] bit for bit."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        steps()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        steps()
    for _ in range(replays):
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for i in range(len(outs)):
            assert torch.equal(outs[i], want[i % 2]), i


def test_two_kernel_merge_back_to_back_in_a_graph(kernels_lib):
    """Calls that share one workspace, back to back in a CUDA graph (each split kernel a programmatic
    dependent of the previous call's reduce kernel, which lets it be scheduled early): alternating
    inputs, so a split kernel overwriting partials the previous reduce still reads would show."""
    import torch

    q, k_cache, v_cache, tables, ctx = _decode_setup(torch)
    q2 = torch.randn_like(q)
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce="two")
    assert op.splits > 1
    outs = [torch.empty_like(q) for _ in range(4)]
    qs = [q, q2, q, q2]
    want = [op(qi, k_cache, v_cache, tables, ctx).clone() for qi in (q, q2)]
    for i in range(4):
        op(qs[i], k_cache, v_cache, tables, ctx, outs[i])
        assert torch.equal(outs[i], want[i % 2])

    def steps():
        for i in range(4):
            op(qs[i], k_cache, v_cache, tables, ctx, outs[i])

    _check_graph_replays(torch, steps, outs, want, 3)
    ref = reference.paged_attention(q2, k_cache, v_cache, tables, ctx)
    assert (outs[1].float() - ref).abs().max().item() < 2e-3
    assert int(op.error_flag.item()) == 0


@pytest.mark.parametrize("query_len", [1, 3])
def test_prefetch_past_reads_the_new_positions_after_the_wait(kernels_lib, query_len):
    """write_kv then attention with prefetch_past (a programmatic dependent of write_kv, as the
    TensorRT plugin launches them), back to back in a CUDA graph with new keys/values alternating:
    every call must see the positions write_kv just wrote, bit-identical to the wait-first kernel."""
    import torch

    B, Hkv, D, BS = 3, 8, 128, 16
    g = torch.Generator().manual_seed(11)
    contexts = [1500, 4000, 333 + query_len]
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(B, contexts, Hkv, D, BS, torch.float16, "cuda",
                                                               generator=g)
    q = torch.randn(B, query_len, 32, D, generator=g).half().cuda()
    pos = [c - query_len + s for c in contexts for s in range(query_len)]
    rows = [b for b in range(B) for _ in range(query_len)]
    tab = tables.cpu()
    slots = torch.tensor([int(tab[b, p // BS]) * BS + p % BS for b, p in zip(rows, pos)], dtype=torch.int32).cuda()
    news = [(torch.randn(B * query_len, Hkv, D, generator=g).half().cuda(),
             torch.randn(B * query_len, Hkv, D, generator=g).half().cuda()) for _ in range(2)]
    plain = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce="two")
    fetch = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce="two", dependent_launch=True,
                                   prefetch_past=True)
    assert fetch.splits > 1
    want = []
    for k, v in news:
        assert kernels.write_kv(k, v, slots, k_cache, v_cache) == 0
        want.append(plain(q, k_cache, v_cache, tables, ctx).clone())
        ref = reference.paged_attention(q, k_cache, v_cache, tables, ctx)
        assert (want[-1].float() - ref).abs().max().item() < 2e-3
    assert not torch.equal(want[0], want[1])

    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    outs = [torch.empty_like(q) for _ in range(4)]

    def steps():
        for i in range(4):
            k, v = news[i % 2]
            kernels.write_kv(k, v, slots, k_cache, v_cache, error_flag=flag)
            fetch(q, k_cache, v_cache, tables, ctx, outs[i])

    steps()
    torch.cuda.synchronize()
    for i in range(4):
        assert torch.equal(outs[i], want[i % 2]), i
    _check_graph_replays(torch, steps, outs, want, 5)
    assert int(flag.item()) == 0 and int(fetch.error_flag.item()) == 0


def _fused_setup(torch, dtype, head_size, block_size, heads, kv_heads, query_len, contexts, seed=21):
    """Caches, tables, a query, the Sq new tokens' K/V [B, Sq, Hkv, D] and their slots [B, Sq], each
    its position's slot in the table (as a paged-KV runtime derives them)."""
    g = torch.Generator().manual_seed(seed)
    B = len(contexts)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(
        B, contexts, kv_heads, head_size, block_size, dtype, "cuda", generator=g)
    q = torch.randn(B, query_len, heads, head_size, generator=g).to(dtype).cuda()
    new_k = torch.randn(B, query_len, kv_heads, head_size, generator=g).to(dtype).cuda()
    new_v = torch.randn(B, query_len, kv_heads, head_size, generator=g).to(dtype).cuda()
    tab = tables.cpu()
    slots = torch.tensor([[int(tab[b, p // block_size]) * block_size + p % block_size for p in range(c - query_len, c)]
                          for b, c in enumerate(contexts)], dtype=torch.int32).cuda()
    return k_cache, v_cache, tables, ctx, q, new_k, new_v, slots


def _write_then_attend(torch, op, q, k_cache, v_cache, tables, ctx, new_k, new_v, slots):
    """The unfused reference path: write_kv, then attention reading the new tokens from the cache."""
    kc, vc = k_cache.clone(), v_cache.clone()
    Hkv, D = new_k.shape[2:]
    assert kernels.write_kv(new_k.reshape(-1, Hkv, D), new_v.reshape(-1, Hkv, D), slots.reshape(-1), kc, vc) == 0
    return op(q, kc, vc, tables, ctx).clone(), kc, vc


FUSED_MODES = [("two", False), ("two", True), ("single", False)]


@pytest.mark.parametrize("reduce,prefetch_past", FUSED_MODES, ids=["two", "two-prefetch", "single"])
@pytest.mark.parametrize("dtype,head_size,block_size,heads,query_len",
                         [(c[0], c[1], c[2], c[3], c[4]) for c in CASES] + WIDE)
def test_fused_write_equals_write_kv_then_attention(kernels_lib, dtype, head_size, block_size, heads, query_len, reduce,
                                                    prefetch_past):
    """The fused KV write gives bit for bit the outputs and caches of write_kv followed by attention:
    new tokens at a sequence's start, mid-page, across a split boundary (1030 tokens, 16 splits: 1024),
    64-row blocks (Sq 16 x G 4), two of them (Sq 16 x G 8), and one token left unwritten (slot -1: read
    from the cache)."""
    import torch

    h, hkv = heads
    dt = getattr(torch, dtype)
    contexts = [query_len, 37 + query_len, 300, 1030]
    k_cache, v_cache, tables, ctx, q, new_k, new_v, slots = _fused_setup(
        torch, dt, head_size, block_size, h, hkv, query_len, contexts)
    slots[2, 0] = -1
    for splits in (0, 16):
        op = kernels.PagedAttention(q, k_cache, v_cache, tables, splits, reduce=reduce, prefetch_past=prefetch_past)
        want, wk, wv = _write_then_attend(torch, op, q, k_cache, v_cache, tables, ctx, new_k, new_v, slots)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = op(q, kc, vc, tables, ctx, new_key=new_k, new_value=new_v, slot_mapping=slots)
        torch.cuda.synchronize()
        assert int(op.error_flag.item()) == 0
        assert torch.equal(kc, wk) and torch.equal(vc, wv), f"splits={splits}: caches differ"
        assert torch.equal(out, want), f"splits={splits}: max diff {(out.float() - want.float()).abs().max().item()}"
        ref = reference.paged_attention(q, wk, wv, tables, ctx)
        assert (out.float() - ref).abs().max().item() < TOL[dtype]


def test_fused_write_back_to_back_in_a_graph(kernels_lib):
    """Fused calls back to back in a CUDA graph (each a programmatic dependent of the previous call's
    reduce), new keys/values alternating: each call sees its own new tokens and leaves them in the
    cache, bit-identical to write_kv + attention."""
    import torch

    contexts = [1500, 4000, 337]
    k_cache, v_cache, tables, ctx, q, k0, v0, slots = _fused_setup(torch, torch.float16, 128, 16, 32, 8, 3, contexts)
    news = [(k0, v0), (torch.randn_like(k0), torch.randn_like(v0))]
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce="two")
    assert op.splits > 1
    want, caches = [], []
    for k, v in news:
        out, kc, vc = _write_then_attend(torch, op, q, k_cache, v_cache, tables, ctx, k, v, slots)
        want.append(out)
        caches.append((kc, vc))
    assert not torch.equal(want[0], want[1])
    outs = [torch.empty_like(q) for _ in range(4)]

    def steps():
        for i in range(4):
            k, v = news[i % 2]
            op(q, k_cache, v_cache, tables, ctx, outs[i], new_key=k, new_value=v, slot_mapping=slots)

    steps()
    torch.cuda.synchronize()
    for i in range(4):
        assert torch.equal(outs[i], want[i % 2]), i
    _check_graph_replays(torch, steps, outs, want, 5)
    kc, vc = caches[1]  # the last call wrote the second set
    assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
    assert int(op.error_flag.item()) == 0


@pytest.mark.parametrize("reduce", REDUCE)
def test_fused_write_flags_a_slot_not_at_its_position(kernels_lib, reduce):
    """A slot that is not its token's slot in the table, or one outside the pool, is not written; that
    sequence's output is NaN and the flag says slot mapping; the other sequence is unaffected."""
    import torch

    contexts = [500, 900]
    k_cache, v_cache, tables, ctx, q, new_k, new_v, slots = _fused_setup(torch, torch.float16, 128, 16, 32, 8, 2,
                                                                         contexts)
    NB, BS = k_cache.shape[:2]
    good = slots.clone()
    # a valid slot elsewhere (sequence 1's position 0), one outside the pool
    for bad_slot in (int(tables[1, 0].item()) * BS, NB * BS):
        slots = good.clone()
        slots[0, 1] = bad_slot
        op = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce=reduce)
        kc, vc = k_cache.clone(), v_cache.clone()
        out = op(q, kc, vc, tables, ctx, new_key=new_k, new_value=new_v, slot_mapping=slots)
        torch.cuda.synchronize()
        assert int(op.error_flag.item()) & 4
        assert torch.isnan(out[0].float()).all() and not torch.isnan(out[1].float()).any()
        if bad_slot < NB * BS:
            assert torch.equal(kc.view(-1, *kc.shape[2:])[bad_slot], k_cache.view(-1, *kc.shape[2:])[bad_slot])
        ref_op = kernels.PagedAttention(q, k_cache, v_cache, tables, 0, reduce=reduce)
        want, _, _ = _write_then_attend(torch, ref_op, q, k_cache, v_cache, tables, ctx, new_k, new_v, good)
        assert torch.equal(out[1], want[1])


def test_fused_write_needs_all_three_inputs(kernels_lib):
    import torch

    k_cache, v_cache, tables, ctx, q, new_k, new_v, slots = _fused_setup(torch, torch.float16, 64, 16, 8, 2, 1, [40])
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, 0)
    with pytest.raises(kernels.KernelError, match="together"):
        op(q, k_cache, v_cache, tables, ctx, new_key=new_k, new_value=new_v)
    with pytest.raises(kernels.KernelError, match="slot_mapping must be"):
        op(q, k_cache, v_cache, tables, ctx, new_key=new_k, new_value=new_v, slot_mapping=slots.reshape(-1))


def test_single_kernel_merge_without_counters_is_an_error(kernels_lib):
    import torch

    q, k_cache, v_cache, tables, ctx = _decode_setup(torch)
    op = kernels.PagedAttention(q, k_cache, v_cache, tables, 4, reduce="single")
    op.num_counters = 0  # as if the caller gave none
    with pytest.raises(kernels.KernelError, match="split counters"):
        op(q, k_cache, v_cache, tables, ctx)


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


@pytest.mark.parametrize("reduce", REDUCE)
def test_block_table_out_of_range_poisons_output_and_flags(kernels_lib, reduce):
    import torch

    g = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(2, [100, 200], 2, 64, 16, torch.float16, "cuda", generator=g)
    q = torch.randn(2, 1, 8, 64, generator=g).half().cuda()
    good_tables = tables.clone()
    tables[1, 3] = k_cache.shape[0] + 5  # page outside the pool
    for splits in (1, 4):
        op = kernels.PagedAttention(q, k_cache, v_cache, tables, splits, reduce=reduce)
        out = op(q, k_cache, v_cache, tables, ctx)
        assert int(op.error_flag.item()) & 1
        assert torch.isnan(out[1]).all(), "the bad sequence must not get a plausible answer"
        ref = reference.paged_attention(q[:1], k_cache, v_cache, tables[:1], ctx[:1])
        assert (out[0].float() - ref[0]).abs().max().item() < 2e-3, "other sequences are unaffected"
        # The bad call still leaves the counters zero: the next (good) call with the same op is right.
        assert int(op.counters.abs().sum().item()) == 0
        out = op(q, k_cache, v_cache, good_tables, ctx)
        ref = reference.paged_attention(q, k_cache, v_cache, good_tables, ctx)
        assert (out.float() - ref).abs().max().item() < 2e-3


@pytest.mark.parametrize("reduce", REDUCE)
def test_context_longer_than_block_table_flags(kernels_lib, reduce):
    import torch

    g = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables, ctx = reference.make_paged_cache(1, [64], 2, 64, 16, torch.float16, "cuda", generator=g)
    q = torch.randn(1, 1, 4, 64, generator=g).half().cuda()
    ctx[0] = 65  # table has 4 pages of 16
    for splits in (0, 2):
        out, flag = kernels.paged_attention(q, k_cache, v_cache, tables, ctx, num_splits=splits, reduce=reduce)
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
