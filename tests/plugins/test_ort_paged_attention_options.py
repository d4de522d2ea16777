"""com.enginesmith.PagedGroupQueryAttention's options (issue 21): soft-capping (softcap), sliding windows
(local_window_size) and head size 256, on fp16 and quantized (int8 / fp8) pages.

Semantics as the dense op's (plugins/ort_ops/attention.h): score = softcap * tanh(scale q.k / softcap)
before the mask; a column at position p sees keys p - W + 1 .. p. With a window the row's pages are read
from the one holding its first column's window start (p0 - W + 1) on: the table entries before it are
never read, so they may hold anything.

CPU (here and in CI): the op's CPU kernel against the numpy reference (plugins/reference.py), decode and
prompt chunks with padding; against the dense op (the same rounding points: bit for bit) on a dense
cache laid out from the pages; table entries before the window ignored; bad attributes named.
GPU (marked gpu): the CUDA path (the paged kernel's kExt variant: the key range starts at the window,
the splits divide it) against the CPU kernel, decode and chunks, D = 64 / 128 / 256, fp16 and
quantized pages, 4k contexts with splits.

Legend: B rows, S columns per row, H / Hkv heads, G = H / Hkv, D head size, BS page size, W window.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from plugin_modules import reference  # noqa: E402
from test_ort_attention import _model as _dense_model  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402
from test_ort_paged_attention import HKV, INPUTS, _case, _close, _written  # noqa: E402
from test_ort_paged_kv_quant import _model, _quantize_case  # noqa: E402


def _numpy(feeds, h, softcap=0.0, window=-1):
    return reference.paged_group_query_attention(*(feeds[n] for n in INPUTS), num_heads=h, kv_num_heads=HKV,
                                                 kv_scale=feeds.get("kv_scale"), softcap=softcap,
                                                 local_window_size=window)


def _options(softcap, window):
    return dict(softcap=softcap or None, local_window_size=window if window > 0 else None)


def _scaled(feeds, factor=4.0):
    """qkv scaled up so that the scores reach the cap (unit-normal q.k / sqrt(D) stay near +-3)."""
    return dict(feeds, qkv=(feeds["qkv"].astype(np.float32) * factor).astype(np.float16))


# (kv, S, D, softcap, W): decode and chunks, head sizes 64 and 256, each option alone and both,
# windows shorter than a page (5), than the context (20), and one column wide (1); int8 / fp8 pages.
CASES = ([("fp16", s, d, cap, w) for s in (1, 5, 16) for d in (64, 256) for cap, w in ((30.0, -1), (0.0, 20), (20.0, 5))]
         + [("fp16", 5, 128, 0.0, 1), ("fp16", 16, 64, 0.0, 200)]
         + [(kv, s, 256, 30.0, 20) for kv in ("int8", "fp8") for s in (1, 16)])


@pytest.mark.parametrize("kv,s,d,softcap,window", CASES)
def test_cpu_kernel_matches_numpy_reference(ops_lib, kv, s, d, softcap, window):
    rng = np.random.default_rng(s * 1000 + d + int(softcap) + window + len(kv))
    h, bs = 4 * HKV, 16
    pasts, reals = [bs + 5, 0, 3 * bs + 1], ([s, max(1, s - 2), 1] if s > 1 else None)
    feeds, real = _case(rng, s, h, d, bs, pasts, reals)
    feeds = _scaled(feeds)
    if kv != "fp16":
        feeds = _quantize_case(rng, feeds, kv)
    out, k_pool, v_pool = _session(_model(h, kv, **_options(softcap, window)), ops_lib).run(None, feeds)
    want, want_k, want_v = _numpy(feeds, h, softcap, window)
    _close(out, want, real)
    assert np.array_equal(k_pool, want_k) and np.array_equal(v_pool, want_v)
    if softcap or window < int(feeds["context_lens"].max()):  # the option changes the result
        plain = _numpy(feeds, h)[0]
        assert not np.allclose(want[real].astype(np.float32), plain[real].astype(np.float32), atol=1e-2)


@pytest.mark.parametrize("s,d,softcap,window", [(1, 64, 30.0, 20), (5, 256, 20.0, -1), (16, 64, 0.0, 7),
                                                 (16, 256, 50.0, 8)])
def test_cpu_kernel_matches_the_dense_op_bit_for_bit(ops_lib, s, d, softcap, window):
    """The oracle: our dense GroupQueryAttention op (checked against com.microsoft's for these options)
    with the same softcap / local_window_size on a dense cache laid out from the pages: the same
    rounding points and summation order, so the same bits."""
    rng = np.random.default_rng(31 + s + d)
    h, bs = 2 * HKV, 16
    pasts, reals = [bs + 5, 0, 3 * bs + 1], ([s, max(1, s - 2), 1] if s > 1 else None)
    feeds, real = _case(rng, s, h, d, bs, pasts, reals)
    feeds = _scaled(feeds)
    tables, ctx = feeds["block_tables"], feeds["context_lens"]
    cap = tables.shape[1] * bs
    past_key = rng.standard_normal((3, HKV, cap, d)).astype(np.float16)
    past_value = rng.standard_normal((3, HKV, cap, d)).astype(np.float16)
    for b, past in enumerate(pasts):
        pos = np.arange(past)
        at = (tables[b, pos // bs], pos % bs)
        past_key[b, :, :past] = feeds["key_pool"][at].transpose(1, 0, 2)
        past_value[b, :, :past] = feeds["value_pool"][at].transpose(1, 0, 2)
    dense = {"qkv": feeds["qkv"], "past_key": past_key, "past_value": past_value, "seqlens_k": ctx - 1,
             "total_sequence_length": np.array(ctx.max(), np.int32), "cos_cache": feeds["cos_cache"],
             "sin_cache": feeds["sin_cache"]}
    scale = 1.0 / math.sqrt(d)
    options = _options(softcap, window)
    want = _session(_dense_model(True, h, HKV, d, scale, **{k: v for k, v in options.items() if v is not None}),
                    ops_lib).run(None, dense)[0]
    out = _session(_model(h, scale=scale, **options), ops_lib).run(None, feeds)[0]
    assert np.array_equal(out[real], want[real])


@pytest.mark.parametrize("kv", ["fp16", "int8"])
def test_window_reads_no_page_before_it(ops_lib, kv):
    """Rows of 100+ cached tokens, a window of 9: the table entries of the pages before the page holding
    the first column's window start may be anything (here outside the pool), and the pool there NaN;
    the output is the one with the true pages, and finite. The page holding the start is read: a bad
    entry there poisons the row."""
    rng = np.random.default_rng(3)
    h, d, bs, s, window = 4, 64, 16, 5, 9
    pasts = [100, 130]
    feeds, real = _case(rng, s, h, d, bs, pasts, [5, 2])
    if kv != "fp16":
        feeds = _quantize_case(rng, feeds, kv)
    sess = _session(_model(h, kv, local_window_size=window), ops_lib)
    want = sess.run(None, feeds)[0]
    _close(want, _numpy(feeds, h, window=window)[0], real)
    other = {n: a.copy() for n, a in feeds.items()}
    first_pages = [(p - window + 1) // bs for p in pasts]  # the first column sits at the past
    nan = np.float16(np.nan) if kv == "fp16" else None
    for b, first in enumerate(first_pages):
        if nan is not None:
            other["key_pool"][other["block_tables"][b, :first]] = nan
            other["value_pool"][other["block_tables"][b, :first]] = nan
        other["block_tables"][b, :first] = feeds["key_pool"].shape[0] + 5
    got = sess.run(None, other)[0]
    assert np.array_equal(got[real], want[real])
    other["block_tables"][0, first_pages[0]] = -3  # the page holding the window start
    bad = sess.run(None, other)[0]
    assert np.isnan(bad[0]).all() and np.array_equal(bad[1][real[1]], want[1][real[1]])
    assert np.isnan(_numpy(other, h, window=window)[0][0]).all()


BAD_OPTIONS = [
    (dict(softcap=-1.0), "softcap must be >= 0 (0: off)"),
    (dict(local_window_size=0), "local_window_size must be positive, or -1 (off)"),
    (dict(local_window_size=-2), "local_window_size must be positive, or -1 (off)"),
]


@pytest.mark.parametrize("options,message", BAD_OPTIONS)
def test_bad_options_are_named(ops_lib, options, message):
    with pytest.raises(Exception, match=re.escape(f"PagedGroupQueryAttention: {message}")):
        _session(_model(4, **options), ops_lib)


# ----------------------------------------------------------------------------- GPU

# (kv, B, S, G, D, BS, longest past, softcap, W): decode and chunks; D 256 with each option; windows
# far shorter than 4k contexts (the key range starts at the window; the splits divide it), a window
# longer than the context, both options on int8 / fp8 pages.
GPU_CASES = [
    ("fp16", 1, 1, 4, 128, 16, 4000, 0.0, 1000),
    ("fp16", 3, 1, 2, 256, 16, 4000, 50.0, -1),
    ("fp16", 4, 1, 2, 256, 32, 4000, 50.0, 4096),
    ("fp16", 1, 16, 2, 256, 16, 4000, 30.0, 500),
    ("fp16", 4, 5, 4, 64, 64, 1500, 30.0, 37),
    ("fp16", 64, 1, 2, 256, 16, 600, 0.0, 64),
    ("fp16", 16, 16, 2, 256, 16, 200, 50.0, 8),
    ("fp16", 2, 16, 8, 64, 16, 600, 0.0, 100),  # G * S = 128 rows: several row blocks per KV head
    ("int8", 1, 1, 2, 256, 16, 4000, 50.0, 1000),
    ("int8", 4, 16, 2, 256, 32, 700, 30.0, 8),
    ("fp8", 3, 5, 4, 128, 16, 2000, 30.0, 300),
    ("fp8", 1, 1, 2, 256, 16, 4000, 0.0, -1),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv,b,s,g,d,bs,past,softcap,window", GPU_CASES)
def test_cuda_matches_cpu(ops_lib, kv, b, s, g, d, bs, past, softcap, window):
    """CUDA against the CPU kernel, three calls (the split counters come back to zero): outputs close
    (the kernel rounds the probabilities to fp16 for P.V), the pools' values the same bits, keys within
    a rounding (quantized: the same codes)."""
    rng = np.random.default_rng(b * 100 + s + d + bs + past + window)
    pasts = [int(x) for x in rng.integers(0, past + 1, b)]
    pasts[0] = past  # the longest row sets the table width (and the splits)
    reals = [s] + [int(x) for x in rng.integers(1, s + 1, b - 1)] if s > 1 else None
    feeds, real = _case(rng, s, g * HKV, d, bs, pasts, reals)
    feeds = _scaled(feeds)
    if kv != "fp16":
        feeds = _quantize_case(rng, feeds, kv)
    model = _model(g * HKV, kv, **_options(softcap, window))
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda="user")
    # Quantized pages: the kernel folds K's channel scales into the fp16 query registers (q_d * s_d rounded
    # to fp16, kernels.cuh scale_query), one more rounding of every score term than the fp32 CPU kernel:
    # with soft-capped scores near the cap that is ~2.6e-3 relative on the output (H200, int8, cap 30).
    tol = 2e-3 if kv == "fp16" else 4e-3
    for _ in range(3):
        got = cuda.run(None, feeds)
        _close(got[0], want[0], real, tol)
        assert np.array_equal(got[2], want[2])
        if kv == "fp16":
            k, w = got[1].astype(np.float32), want[1].astype(np.float32)
            assert np.abs(k - w).max() <= 2e-3 * max(1.0, float(np.abs(w).max()))
        else:
            assert np.array_equal(got[1], want[1])


@gpu
@pytest.mark.gpu
def test_cuda_window_reads_no_page_before_it(ops_lib):
    """As test_window_reads_no_page_before_it on the GPU, with a 4k context split over the window: table
    entries before the window outside the pool, the pool there NaN: the output is unchanged."""
    rng = np.random.default_rng(9)
    h, d, bs, s, window = 4, 128, 16, 1, 700
    pasts = [4000, 2500]
    feeds, real = _case(rng, s, h, d, bs, pasts)
    model = _model(h, local_window_size=window)
    cuda = _session(model, ops_lib, cuda="user")
    want = _session(model, ops_lib).run(None, feeds)[0]
    _close(cuda.run(None, feeds)[0], want, real)
    other = {n: a.copy() for n, a in feeds.items()}
    for b, p in enumerate(pasts):
        first = (p - window + 1) // bs
        other["key_pool"][other["block_tables"][b, :first]] = np.float16(np.nan)
        other["value_pool"][other["block_tables"][b, :first]] = np.float16(np.nan)
        other["block_tables"][b, :first] = feeds["key_pool"].shape[0] + 5
    _close(cuda.run(None, other)[0], want, real)


@gpu
@pytest.mark.gpu
def test_cuda_written_slots_with_a_window(ops_lib):
    """The fused KV write with the key range moved to the window: every real column's slot is written
    (by the split holding its position), nothing else."""
    rng = np.random.default_rng(10)
    h, d, bs, s = 4, 256, 16, 16
    feeds, real = _case(rng, s, h, d, bs, [3000, 100, 40], [16, 9, 3])
    model = _model(h, local_window_size=8)
    want = _session(model, ops_lib).run(None, feeds)
    got = _session(model, ops_lib, cuda="user").run(None, feeds)
    written = _written(feeds)
    assert np.array_equal(got[2], want[2])
    for g, before in ((got[1], feeds["key_pool"]), (got[2], feeds["value_pool"])):
        assert np.array_equal(g.reshape(written.size, -1)[~written], before.reshape(written.size, -1)[~written])
    _close(got[0], want[0], real)
