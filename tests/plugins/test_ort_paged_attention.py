"""com.enginesmith.PagedGroupQueryAttention (plugins/ort_ops/paged_gqa.h).

CPU (here and in CI): the op's CPU kernel against the numpy reference (plugins/reference.py) and
against our dense GroupQueryAttention op (the verified one) on a dense cache laid out from the pages;
padding columns, bad device data (NaN rows), bad shapes (named errors).
GPU (marked gpu): the CUDA path (rotary kernel + paged attention with the fused KV write) against the
CPU kernel: decode and chunks up to B = 64, 4k contexts with splits, repeated calls, pools updated in
place, a torch CUDA-graph capture, and the last-block split merge (in a child process).

Legend: B rows, S columns (new tokens) per row, H / Hkv heads, G = H / Hkv, D head size, BS page size.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

from plugin_modules import reference  # noqa: E402
from test_ort_attention import _model as _dense_model  # noqa: E402
import test_ort_ops  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402

INPUTS = ["qkv", "key_pool", "value_pool", "block_tables", "context_lens", "slot_mapping", "cos_cache", "sin_cache"]
OUTPUTS = ["out", "present_key_pool", "present_value_pool"]
INT32_INPUTS = ("block_tables", "context_lens", "slot_mapping")
HKV = 2


def _model(h: int, hkv: int, scale: float | None = None):
    attrs = dict(num_heads=h, kv_num_heads=hkv) | ({} if scale is None else dict(scale=scale))
    node = helper.make_node("PagedGroupQueryAttention", INPUTS, OUTPUTS, domain="com.enginesmith", **attrs)
    inputs = [helper.make_tensor_value_info(n, T.INT32 if n in INT32_INPUTS else T.FLOAT16, None) for n in INPUTS]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT16, None) for n in OUTPUTS]
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1)])


def _rotary(positions: int, d: int):
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = np.arange(positions)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float16), np.sin(ang).astype(np.float16)


def _case(rng, s, h, d, bs, pasts, reals=None, spare=2, positions=None):
    """Feeds for rows with pasts[b] cached tokens and reals[b] (default S) real columns, padded on the
    right to S: context_lens = past + S (the padding positions included, as the runtime sets them).
    Each row's pages are scattered through the pool; page 0 is the null page, shared by every table
    entry past a row's pages (padding positions may land there). Returns (feeds, real [B, S])."""
    b_rows = len(pasts)
    reals = reals or [s] * b_rows
    ctx = [p + s for p in pasts]
    used = [(p + r + bs - 1) // bs for p, r in zip(pasts, reals)]  # pages holding real tokens
    mb = max((c + bs - 1) // bs for c in ctx)
    nb = 1 + sum(used) + spare
    perm = rng.permutation(np.arange(1, nb)).astype(np.int32)
    tables = np.zeros((b_rows, mb), np.int32)
    i = 0
    for b, n in enumerate(used):
        tables[b, :n] = perm[i:i + n]
        i += n
    slots = np.full((b_rows, s), -1, np.int32)
    for b, (past, real) in enumerate(zip(pasts, reals)):
        for col in range(real):
            pos = past + col
            slots[b, col] = tables[b, pos // bs] * bs + pos % bs
    cos, sin = _rotary(positions or mb * bs, d)
    feeds = {
        "qkv": rng.standard_normal((b_rows, s, (h + 2 * HKV) * d)).astype(np.float16),
        "key_pool": rng.standard_normal((nb, bs, HKV, d)).astype(np.float16),
        "value_pool": rng.standard_normal((nb, bs, HKV, d)).astype(np.float16),
        "block_tables": tables,
        "context_lens": np.array(ctx, np.int32),
        "slot_mapping": slots,
        "cos_cache": cos,
        "sin_cache": sin,
    }
    return feeds, slots != -1


def _numpy(feeds, h, scale=0.0):
    return reference.paged_group_query_attention(*(feeds[n] for n in INPUTS), num_heads=h, kv_num_heads=HKV,
                                                 scale=scale)


def _close(got, want, real, tol=2e-3):
    """Real columns of the outputs [B, S, H D] close (fp32 scores either way, summed in another order)."""
    g, w = got[real].astype(np.float32), want[real].astype(np.float32)
    assert np.isfinite(g).all()
    err = float(np.abs(g - w).max())
    assert err <= tol * max(1.0, float(np.abs(w).max())), err


def _written(feeds) -> np.ndarray:
    """Mask [NB * BS] of the slots the call writes."""
    nb, bs = feeds["key_pool"].shape[:2]
    mask = np.zeros(nb * bs, bool)
    slots = feeds["slot_mapping"]
    mask[slots[slots >= 0]] = True
    return mask


# (S, BS, D, G): decode and chunks, both page sizes, both head sizes, GQA groups 1 and 4.
CASES = [(s, bs, d, g) for s in (1, 5, 16) for bs in (16, 32) for d in (64, 128) for g in (1, 4)]


def _rows(s, bs):
    """Three rows of different lengths; chunks pad two of them on the right."""
    pasts = [bs + 5, 0, 3 * bs + 1]
    return pasts, ([s, max(1, s - 2), 1] if s > 1 else None)


@pytest.mark.parametrize("s,bs,d,g", CASES)
def test_cpu_kernel_matches_numpy_reference(ops_lib, s, bs, d, g):
    rng = np.random.default_rng(s * 1000 + bs * 10 + d + g)
    h = g * HKV
    pasts, reals = _rows(s, bs)
    feeds, real = _case(rng, s, h, d, bs, pasts, reals)
    out, k_pool, v_pool = _session(_model(h, HKV), ops_lib).run(None, feeds)
    want, want_k, want_v = _numpy(feeds, h)
    assert out.shape == (3, s, h * d) and out.dtype == np.float16
    _close(out, want, real)
    # the pools: written at the real columns' slots (keys rotated, values as given), the same bits
    assert np.array_equal(k_pool, want_k) and np.array_equal(v_pool, want_v)
    written = _written(feeds)
    assert written.sum() == real.sum()
    for got, before in ((k_pool, feeds["key_pool"]), (v_pool, feeds["value_pool"])):
        flat, flat_before = got.reshape(written.size, -1), before.reshape(written.size, -1)
        assert np.array_equal(flat[~written], flat_before[~written])  # everything else untouched
        assert np.array_equal(got[0], before[0])  # the null page included
        assert not np.array_equal(flat[written], flat_before[written])


@pytest.mark.parametrize("s,bs,d,g", [c for c in CASES if c[1] == 16])
def test_cpu_kernel_matches_dense_group_query_attention(ops_lib, s, bs, d, g):
    """The oracle: our dense GroupQueryAttention op (verified against com.microsoft's) on the same data,
    its cache laid out from the pages. The dense op knows no padding: it takes a padding column as a
    token at the same position, which no real column sees (it is to their right)."""
    rng = np.random.default_rng(7 + s + d + g)
    h = g * HKV
    pasts, reals = _rows(s, bs)
    feeds, real = _case(rng, s, h, d, bs, pasts, reals)
    tables, ctx = feeds["block_tables"], feeds["context_lens"]
    cap = tables.shape[1] * bs
    past_key = rng.standard_normal((3, HKV, cap, d)).astype(np.float16)  # noise beyond the pasts
    past_value = rng.standard_normal((3, HKV, cap, d)).astype(np.float16)
    for b, past in enumerate(pasts):
        pos = np.arange(past)
        at = (tables[b, pos // bs], pos % bs)
        past_key[b, :, :past] = feeds["key_pool"][at].transpose(1, 0, 2)
        past_value[b, :, :past] = feeds["value_pool"][at].transpose(1, 0, 2)
    dense = {"qkv": feeds["qkv"], "past_key": past_key, "past_value": past_value, "seqlens_k": ctx - 1,
             "total_sequence_length": np.array(ctx.max(), np.int32), "cos_cache": feeds["cos_cache"],
             "sin_cache": feeds["sin_cache"]}
    scale = 1.0 / math.sqrt(d)  # given to both (the attribute's float32)
    want, want_k, want_v = _session(_dense_model(True, h, HKV, d, scale), ops_lib).run(None, dense)
    out, k_pool, v_pool = _session(_model(h, HKV, scale), ops_lib).run(None, feeds)
    assert np.array_equal(out[real], want[real])  # same rounding points, same summation order
    for b, past in enumerate(pasts):  # the new keys and values as the dense op wrote them
        cols = np.flatnonzero(real[b])
        pos = past + cols
        at = (tables[b, pos // bs], pos % bs)
        assert np.array_equal(k_pool[at], want_k[b][:, pos].transpose(1, 0, 2))
        assert np.array_equal(v_pool[at], want_v[b][:, pos].transpose(1, 0, 2))


def test_real_columns_do_not_depend_on_padding(ops_lib):
    """Other padding inputs and other (finite) pool contents at the padding positions: the real
    outputs and every pool slot but the padding ones' are unchanged, and no padding slot is written."""
    rng = np.random.default_rng(11)
    h, d, bs, s = 8, 64, 16, 16
    feeds, real = _case(rng, s, h, d, bs, [20, 3, 40], [16, 7, 2])
    sess = _session(_model(h, HKV), ops_lib)
    out, k_pool, v_pool = sess.run(None, feeds)
    other = {n: a.copy() for n, a in feeds.items()}
    other["qkv"][~real] = rng.standard_normal(other["qkv"][~real].shape).astype(np.float16)
    tables, ctx = feeds["block_tables"], feeds["context_lens"]
    for b in range(3):
        for col in np.flatnonzero(~real[b]):
            pos = ctx[b] - s + col
            for pool in ("key_pool", "value_pool"):
                other[pool][tables[b, pos // bs], pos % bs] = rng.standard_normal((HKV, d)).astype(np.float16)
    out2, k_pool2, v_pool2 = sess.run(None, other)
    assert np.array_equal(out2[real], out[real])
    for got, before in ((k_pool2, other["key_pool"]), (v_pool2, other["value_pool"])):
        keep = ~_written(feeds)
        assert np.array_equal(got.reshape(keep.size, -1)[keep], before.reshape(keep.size, -1)[keep])
    written = _written(feeds)
    assert np.array_equal(k_pool2.reshape(written.size, -1)[written], k_pool.reshape(written.size, -1)[written])


def test_scale_attribute(ops_lib):
    rng = np.random.default_rng(4)
    h, d = 8, 128
    feeds, real = _case(rng, 5, h, d, 16, [9, 30], [5, 3])
    default = _session(_model(h, HKV), ops_lib).run(None, feeds)[0]
    zero = _session(_model(h, HKV, 0.0), ops_lib).run(None, feeds)[0]
    explicit = _session(_model(h, HKV, 1.0 / math.sqrt(d)), ops_lib).run(None, feeds)[0]
    assert np.array_equal(default[real], zero[real]) and np.array_equal(default[real], explicit[real])
    other = _session(_model(h, HKV, 0.3), ops_lib).run(None, feeds)[0]
    _close(other, _numpy(feeds, h, scale=0.3)[0], real)
    assert not np.allclose(other[real], default[real])


def test_bad_device_data_gives_nan_rows(ops_lib):
    """A length beyond the table, a slot not at its position, a page outside the pool: that row is NaN
    (the others exact), as the numpy reference says; nothing of a bad-length row is written, a bad slot
    is not written."""
    rng = np.random.default_rng(5)
    h, d, bs, s = 8, 64, 16, 5
    feeds, real = _case(rng, s, h, d, bs, [10, 20, 30, 40, 12], [5, 5, 5, 5, 5], spare=4)
    tables, nb = feeds["block_tables"], feeds["key_pool"].shape[0]
    spare_page = int(np.setdiff1d(np.arange(1, nb), tables).max())
    feeds["context_lens"][1] = tables.shape[1] * bs + 1  # beyond the block table
    feeds["slot_mapping"][2, 3] = spare_page * bs  # not its position's slot
    feeds["block_tables"][3, 0] = nb + 7  # a past page outside the pool
    out, k_pool, v_pool = _session(_model(h, HKV), ops_lib).run(None, feeds)
    want, want_k, want_v = _numpy(feeds, h)
    assert np.isnan(out[1:4]).all() and np.isnan(want[1:4]).all()
    _close(out[[0, 4]], want[[0, 4]], real[[0, 4]])
    assert np.array_equal(k_pool, want_k) and np.array_equal(v_pool, want_v)
    flat = k_pool.reshape(nb * bs, -1)
    before = feeds["key_pool"].reshape(nb * bs, -1)
    assert np.array_equal(flat[feeds["slot_mapping"][1]], before[feeds["slot_mapping"][1]])  # row 1: none
    assert np.array_equal(flat[spare_page * bs], before[spare_page * bs])  # the bad slot: not written
    good = feeds["slot_mapping"][2, [0, 1, 2, 4]]
    assert not np.array_equal(flat[good], before[good])  # row 2's good slots: written


def test_real_column_beyond_the_rotary_tables_gives_nan(ops_lib):
    """The rotary tables hold P positions: a row whose real columns reach P is NaN and writes nothing;
    one whose padding alone reaches past P is fine."""
    rng = np.random.default_rng(6)
    h, d, bs, s = 4, 64, 16, 4
    feeds, real = _case(rng, s, h, d, bs, [30, 30], [4, 1], positions=33)  # row 0: positions 30..33
    out, k_pool, _ = _session(_model(h, HKV), ops_lib).run(None, feeds)
    assert np.isnan(out[0]).all()
    _close(out[1:], _numpy(feeds, h)[0][1:], real[1:])
    nb, bs_ = feeds["key_pool"].shape[:2]
    flat, before = k_pool.reshape(nb * bs_, -1), feeds["key_pool"].reshape(nb * bs_, -1)
    assert np.array_equal(flat[feeds["slot_mapping"][0]], before[feeds["slot_mapping"][0]])


def _one_row(s=1, d=64, bs=16):
    """A one-row case (4 query heads, 5 cached tokens): 4 pages of 16, 16 rotary positions by default."""
    return _case(np.random.default_rng(0), s, 4, d, bs, [5])[0]


BAD_SHAPES = [
    (lambda f: f | {"key_pool": f["key_pool"][:, :, :1].copy()},
     "key_pool must be float16 [num_blocks, block_size, kv_num_heads = 2, head_size = 64], got float16 [4, 16, 1, 64]"),
    (lambda f: f | {"value_pool": f["value_pool"][:-1].copy()},
     "value_pool must be float16 with key_pool's shape [4, 16, 2, 64], got float16 [3, 16, 2, 64]"),
    (lambda f: f | {"block_tables": np.zeros((2, 1), np.int32)},
     "block_tables must be int32 [batch = 1, max_blocks_per_seq], got int32 [2, 1]"),
    (lambda f: f | {"context_lens": np.array([[6]], np.int32)},
     "context_lens must be int32 [batch = 1], got int32 [1, 1]"),
    (lambda f: f | {"slot_mapping": np.full((1, 2), -1, np.int32)},
     "slot_mapping must be int32 [batch = 1, seq = 1], got int32 [1, 2]"),
    (lambda f: f | {"cos_cache": f["cos_cache"][:, :-1].copy()},
     "cos_cache must be float16 [positions, head_size / 2 = 32], got float16 [16, 31]"),
    (lambda f: f | {"sin_cache": f["sin_cache"][:-1].copy()},
     "sin_cache must be float16 with cos_cache's shape [16, 32], got float16 [15, 32]"),
    (lambda f: f | {"qkv": f["qkv"][..., :-1].copy()},
     "qkv must be float16 [batch, seq, (num_heads + 2 kv_num_heads) * head_size] with num_heads = 4, kv_num_heads = 2"),
    (lambda f: _one_row(d=96), "paged attention: head size 96 is not supported (supported: 64, 128, 256)"),
    (lambda f: _one_row(bs=8), "paged attention: block size 8 is not supported (supported: 16, 32, 64)"),
    (lambda f: _one_row(s=17), "paged attention: query length 17 is outside [1, 16]"),
]


@pytest.mark.parametrize("change,message", BAD_SHAPES, ids=[f"{m.split()[0]}-{i}" for i, (_, m) in enumerate(BAD_SHAPES)])
def test_bad_shapes_are_named(ops_lib, change, message):
    feeds = _one_row()
    with pytest.raises(Exception, match=re.escape("PagedGroupQueryAttention: " + message)):
        _session(_model(4, HKV), ops_lib).run(None, change(feeds))


def test_heads_not_a_multiple_fail_at_session_creation(ops_lib):
    with pytest.raises(Exception, match="num_heads must be a positive multiple of kv_num_heads"):
        _session(_model(6, 4), ops_lib)


# ----------------------------------------------------------------------------- GPU

def _compare_cuda(got, want, real):
    """CUDA against the CPU kernel: real outputs close (the paged kernel rounds the probabilities to
    fp16 for P·V), values in the pools the same bits, keys within a rounding."""
    _close(got[0], want[0], real)
    assert np.array_equal(got[2], want[2])
    k, w = got[1].astype(np.float32), want[1].astype(np.float32)
    assert np.abs(k - w).max() <= 2e-3 * max(1.0, float(np.abs(w).max()))


def _gpu_case(seed, b_rows, s, g, d, bs, max_past):
    rng = np.random.default_rng(seed)
    pasts = [int(x) for x in rng.integers(0, max_past + 1, b_rows)]
    pasts[0] = max_past  # the longest row sets the table width (and the splits)
    reals = [s] + [int(x) for x in rng.integers(1, s + 1, b_rows - 1)] if s > 1 else None
    feeds, real = _case(rng, s, g * HKV, d, bs, pasts, reals)
    return feeds, real


# (B, S, G, D, BS, longest past): decode and chunks up to B = 64; 4k contexts split the keys.
GPU_CASES = [
    (1, 1, 4, 128, 16, 4000),
    (3, 1, 1, 64, 32, 4000),
    (1, 16, 4, 128, 16, 4000),
    (4, 5, 4, 64, 64, 4000),
    (64, 1, 4, 128, 16, 1000),
    (64, 5, 4, 64, 32, 300),
    (64, 16, 1, 128, 16, 200),
    (2, 16, 8, 64, 16, 600),  # G * S = 128 rows: several row blocks per KV head
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,s,g,d,bs,past", GPU_CASES)
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_matches_cpu(ops_lib, b, s, g, d, bs, past, stream):
    feeds, real = _gpu_case(b * 100 + s + d + bs, b, s, g, d, bs, past)
    model = _model(g * HKV, HKV)
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda=stream)
    for _ in range(3):  # the split counters come back to zero after every call
        _compare_cuda(cuda.run(None, feeds), want, real)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,s,g,d,bs,past", [GPU_CASES[4], GPU_CASES[5], GPU_CASES[0]])
def test_cuda_matches_cpu_with_splits_for_more_waves(ops_lib, monkeypatch, b, s, g, d, bs, past):
    """ES_PAGED_SPLIT_WAVES=4 (more key splits at mid batches, for measuring) gives the CPU kernel's results."""
    monkeypatch.setenv("ES_PAGED_SPLIT_WAVES", "4")
    feeds, real = _gpu_case(b * 100 + s + d + bs, b, s, g, d, bs, past)
    model = _model(g * HKV, HKV)
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda="ort")
    for _ in range(2):
        _compare_cuda(cuda.run(None, feeds), want, real)


@gpu
@pytest.mark.gpu
def test_cuda_bad_device_data_gives_nan_rows(ops_lib):
    rng = np.random.default_rng(5)
    h, d, bs, s = 8, 64, 16, 5
    feeds, real = _case(rng, s, h, d, bs, [10, 20, 30, 40, 12], [5, 5, 5, 5, 5], spare=4)
    tables, nb = feeds["block_tables"], feeds["key_pool"].shape[0]
    feeds["context_lens"][1] = tables.shape[1] * bs + 1
    feeds["slot_mapping"][2, 3] = int(np.setdiff1d(np.arange(1, nb), tables).max()) * bs
    feeds["block_tables"][3, 0] = nb + 7
    model = _model(h, HKV)
    want = _session(model, ops_lib).run(None, feeds)
    got = _session(model, ops_lib, cuda="user").run(None, feeds)
    assert np.isnan(got[0][1:4]).all()
    _compare_cuda([got[0][[0, 4]], got[1], got[2]], [want[0][[0, 4]], want[1], want[2]], real[[0, 4]])


def _decode_steps(rng, h, d, bs, pasts, steps):
    """Feeds for `steps` decode steps of rows with `pasts` cached tokens; the tables hold every page the
    steps need (scattered, page 0 the null page), the pools are shared by all steps."""
    feeds, _ = _case(rng, 1, h, d, bs, [p + steps - 1 for p in pasts])
    out = []
    for step in range(steps):
        f = dict(feeds, qkv=rng.standard_normal(feeds["qkv"].shape).astype(np.float16))
        ctx = np.array([p + step + 1 for p in pasts], np.int32)
        pos = ctx - 1
        f["context_lens"] = ctx
        pages = f["block_tables"][np.arange(len(pasts)), pos // bs]
        f["slot_mapping"] = (pages * bs + pos % bs)[:, None].astype(np.int32)
        out.append(f)
    return out


def _bind(io, name, t):
    import torch

    io_type = np.int32 if t.dtype == torch.int32 else np.float16
    (io.bind_output if name in OUTPUTS else io.bind_input)(name, "cuda", 0, io_type, list(t.shape), t.data_ptr())


@gpu
@pytest.mark.gpu
def test_cuda_updates_the_pools_in_place(ops_lib):
    """key_pool / present_key_pool bound to one device buffer (as the engine binds them): the pools grow
    in place over decode steps; each step matches the CPU kernel."""
    import torch

    h, d, bs = 8, 128, 16
    rng = np.random.default_rng(8)
    steps = _decode_steps(rng, h, d, bs, [500, 17, 2000], 5)
    model = _model(h, HKV)
    cpu, cuda = _session(model, ops_lib), _session(model, ops_lib, cuda="ort")
    k_ref, v_ref = steps[0]["key_pool"], steps[0]["value_pool"]
    k_dev, v_dev = torch.from_numpy(k_ref.copy()).cuda(), torch.from_numpy(v_ref.copy()).cuda()
    for f in steps:
        f = dict(f, key_pool=k_ref, value_pool=v_ref)
        want = cpu.run(None, f)
        k_ref, v_ref = want[1], want[2]
        io = cuda.io_binding()
        io.bind_output("out", "cpu")
        for name in ("qkv", "block_tables", "context_lens", "slot_mapping", "cos_cache", "sin_cache"):
            io.bind_cpu_input(name, f[name])
        for name, t in (("key_pool", k_dev), ("present_key_pool", k_dev), ("value_pool", v_dev),
                        ("present_value_pool", v_dev)):
            _bind(io, name, t)
        cuda.run_with_iobinding(io)
        got = io.copy_outputs_to_cpu()[0]
        _compare_cuda([got, k_dev.cpu().numpy(), v_dev.cpu().numpy()], want, np.ones((3, 1), bool))


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("s", [1, 5])
def test_cuda_graph_captured_by_torch_replays_new_steps(ops_lib, s):
    """As the in-flight-batching engine runs it: ORT on a user stream, every input and output bound to a
    fixed device tensor, one plain run (the workspace grows), then torch.cuda.graph captures the run and
    each step only refreshes the tensors and replays: lengths, slots and tables are read on the device."""
    import torch

    h, d, bs = 8, 64, 16
    rng = np.random.default_rng(12 + s)
    pasts = [3000, 40, 700]
    feeds, _ = _case(rng, s, h, d, bs, [p + 4 * s for p in pasts])
    model = _model(h, HKV)
    cpu, cuda = _session(model, ops_lib), _session(model, ops_lib, cuda="user")
    stream = test_ort_ops._STREAMS[-1]  # the session's compute stream
    dev = {n: torch.from_numpy(a.copy()).cuda() for n, a in feeds.items()}
    out = torch.empty(len(pasts), s, h * d, dtype=torch.float16, device="cuda")
    io = cuda.io_binding()
    for name, t in dev.items():
        _bind(io, name, t)
    _bind(io, "out", out)
    _bind(io, "present_key_pool", dev["key_pool"])
    _bind(io, "present_value_pool", dev["value_pool"])
    options = ort.RunOptions()
    options.add_run_config_entry("disable_synchronize_execution_providers", "1")

    def step_feeds(step):
        ctx = np.array([p + (step + 1) * s for p in pasts], np.int32)
        pos = ctx[:, None] - s + np.arange(s)[None, :]
        rows = np.arange(len(pasts))[:, None]
        slots = (feeds["block_tables"][rows, pos // bs] * bs + pos % bs).astype(np.int32)
        return {"qkv": rng.standard_normal(feeds["qkv"].shape).astype(np.float16), "context_lens": ctx,
                "slot_mapping": slots}

    torch.cuda.synchronize()
    k_ref, v_ref = feeds["key_pool"], feeds["value_pool"]
    graph = None
    for step in range(4):
        new = step_feeds(step)
        want = cpu.run(None, feeds | new | {"key_pool": k_ref, "value_pool": v_ref})
        k_ref, v_ref = want[1], want[2]
        with torch.cuda.stream(stream):
            for name, a in new.items():
                dev[name].copy_(torch.from_numpy(a))
            if step == 0:
                cuda.run_with_iobinding(io, options)  # plain: the workspace grows here
            else:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                        cuda.run_with_iobinding(io, options)
                graph.replay()
        stream.synchronize()
        got = [out.cpu().numpy(), dev["key_pool"].cpu().numpy(), dev["value_pool"].cpu().numpy()]
        _compare_cuda(got, want, np.ones((len(pasts), s), bool))


@gpu
@pytest.mark.gpu
def test_cuda_last_block_merge_in_a_child_process(ops_lib):
    """ES_PAGED_ATTENTION_REDUCE=single (read once per process): the splits merged by the last block,
    its counters back to zero after every call (test_cuda_matches_cpu's repeated calls)."""
    if os.environ.get("ES_PAGED_ATTENTION_REDUCE") == "single":
        pytest.skip("this process runs the last-block merge already")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, ES_PAGED_ATTENTION_REDUCE="single", ENGINESMITH_ORT_OPS_LIB=str(ops_lib))
    names = ("test_cuda_matches_cpu", "test_cuda_graph_captured_by_torch_replays_new_steps")
    tests = [f"{__file__}::{name}" for name in names]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests],
                          cwd=repo / "tests", env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
