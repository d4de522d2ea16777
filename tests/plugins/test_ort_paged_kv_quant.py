"""com.enginesmith.PagedGroupQueryAttention over quantized KV pages (plugins/paged_attention/kv_quant.h):
int8 pools, and uint8 pools of fp8 e4m3 codes, with static channel scales kv_scale [2, Hkv, D].

CPU (here and in CI): the op's CPU kernel against the numpy reference that encodes and decodes the same
way (plugins/reference.py kv_encode / kv_decode): the codes written are the same bits, the outputs
close; the scales' and pools' types are checked with named errors.
GPU (marked gpu): the CUDA path (the rotary kernel encodes, the paged kernel widens codes in its K/V
loads with the scales folded into the query and the output) against the CPU kernel, decode and chunk
shapes, 4k contexts with splits.

Legend: B rows, S columns per row, H / Hkv heads, G = H / Hkv, D head size, BS page size.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

from plugin_modules import reference  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402
from test_ort_paged_attention import HKV, INPUTS, INT32_INPUTS, OUTPUTS, _case, _written  # noqa: E402

POOL = {"int8": (np.int8, T.INT8), "fp8": (np.uint8, T.UINT8)}
CODE_MAX = {"int8": 127.0, "fp8": 448.0}


def _model(h: int, kv: str = "fp16", with_scale: bool | None = None, scale: float | None = None, **options):
    """One PagedGroupQueryAttention node over `kv` pools; kv_scale an input when `with_scale` (default: for
    quantized pools); `options`: softcap, local_window_size (left out when None)."""
    pool_type = POOL[kv][1] if kv in POOL else T.FLOAT16
    names = INPUTS + (["kv_scale"] if (kv in POOL if with_scale is None else with_scale) else [])
    attrs = dict(num_heads=h, kv_num_heads=HKV) | ({} if scale is None else dict(scale=scale))
    attrs |= {k: v for k, v in options.items() if v is not None}
    node = helper.make_node("PagedGroupQueryAttention", names, OUTPUTS, domain="com.enginesmith", **attrs)

    def type_of(n):
        return (T.INT32 if n in INT32_INPUTS else pool_type if n in ("key_pool", "value_pool")
                else T.FLOAT if n == "kv_scale" else T.FLOAT16)

    inputs = [helper.make_tensor_value_info(n, type_of(n), None) for n in names]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT16 if n == "out" else pool_type, None) for n in OUTPUTS]
    graph = helper.make_graph([node], "g", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1)])


def _quantize_case(rng, feeds, kv: str, fit: bool = False):
    """The case's fp16 pools -> codes, plus kv_scale [2, Hkv, D]: scales at random channel bounds
    (values beyond saturate), or with `fit` at the data's bounds as the pass calibrates them (the pools'
    absmax, the new keys' rotation-invariant pair norm, the new values' absmax)."""
    d = feeds["key_pool"].shape[-1]
    if fit:
        qkv = feeds["qkv"].astype(np.float32)
        heads = qkv.shape[-1] // d
        new = qkv.reshape(-1, heads, d)[:, heads - 2 * HKV:]
        k, v = new[:, :HKV], new[:, HKV:]
        pair = np.sqrt(k[..., :d // 2] ** 2 + k[..., d // 2:] ** 2).max(0)
        bound = np.stack([np.maximum(np.abs(feeds["key_pool"]).reshape(-1, HKV, d).max(0), np.concatenate([pair, pair], -1)),
                          np.maximum(np.abs(feeds["value_pool"]).reshape(-1, HKV, d).max(0), np.abs(v).max(0))])
    else:
        bound = np.full((2, HKV, d), 2.5, np.float32) * rng.uniform(0.5, 1.5, (2, HKV, d))
    scale = (bound / CODE_MAX[kv]).astype(np.float32)
    out = dict(feeds, kv_scale=scale)
    for which, name in enumerate(("key_pool", "value_pool")):
        out[name] = reference.kv_encode(feeds[name], scale[which], POOL[kv][0])
    return out


def _numpy(feeds, h):
    return reference.paged_group_query_attention(*(feeds[n] for n in INPUTS), num_heads=h, kv_num_heads=HKV,
                                                 kv_scale=feeds["kv_scale"])


def _close(got, want, real):
    """Real columns close: the same decoded values, fp32 scores either way, summed in another order."""
    g, w = got[real].astype(np.float32), want[real].astype(np.float32)
    assert np.isfinite(g).all()
    err = float(np.abs(g - w).max())
    assert err <= 2e-3 * max(1.0, float(np.abs(w).max())), err


def test_reference_codes_round_and_saturate():
    scale = np.array([[0.5, 2.0]], np.float32)  # [Hkv = 1, D = 2]
    x = np.array([[[0.25, 3.0]], [[0.75, 1e6]], [[-0.26, -1e6]]], np.float32)  # [3, 1, 2]
    codes = reference.kv_encode(x, scale, np.int8)
    assert codes.dtype == np.int8 and codes[..., 0].ravel().tolist() == [0, 2, -1]  # ties to even: 0.5 -> 0, 1.5 -> 2
    assert codes[..., 1].ravel().tolist() == [2, 127, -127]
    fp8 = reference.kv_encode(x, scale, np.uint8)
    assert reference.kv_decode(fp8, scale)[1:, 0, 1].tolist() == [448 * 2.0, -448 * 2.0]  # saturated, finite
    assert np.allclose(reference.kv_decode(fp8, scale)[0], x[0], rtol=1 / 16)


CASES = [(kv, s, bs, d, g) for kv in ("int8", "fp8") for s in (1, 5, 16) for bs in (16, 32) for d, g in ((64, 4), (128, 1))]


@pytest.mark.parametrize("kv,s,bs,d,g", CASES)
def test_cpu_kernel_matches_numpy_reference(ops_lib, kv, s, bs, d, g):
    rng = np.random.default_rng(s * 100 + bs + d + g + len(kv))
    h = g * HKV
    pasts, reals = [bs + 5, 0, 3 * bs + 1], ([s, max(1, s - 2), 1] if s > 1 else None)
    feeds, real = _case(rng, s, h, d, bs, pasts, reals)
    feeds = _quantize_case(rng, feeds, kv)
    out, k_pool, v_pool = _session(_model(h, kv), ops_lib).run(None, feeds)
    want, want_k, want_v = _numpy(feeds, h)
    assert k_pool.dtype == POOL[kv][0] and v_pool.dtype == POOL[kv][0]
    _close(out, want, real)
    assert np.array_equal(k_pool, want_k) and np.array_equal(v_pool, want_v)  # the same codes, bit for bit
    written = _written(feeds)
    for got, before in ((k_pool, feeds["key_pool"]), (v_pool, feeds["value_pool"])):
        flat, flat_before = got.reshape(written.size, -1), before.reshape(written.size, -1)
        assert np.array_equal(flat[~written], flat_before[~written])


def test_quantized_output_is_close_to_fp16(ops_lib):
    """The same data through fp16 pools and quantized pools with fitted scales: the output is the fp16
    one within the quantization error. Unit-normal data, bounds ~4.5: an int8 code step is ~0.035, so
    each value is off by <= 0.018 (outputs, weighted means of values: about that); fp8 keeps 3
    mantissa bits, <= 1/16 of a value."""
    rng = np.random.default_rng(3)
    h, d, bs, s = 8, 64, 16, 5
    feeds, real = _case(rng, s, h, d, bs, [40, 70], [5, 2])
    fp16 = _session(_model(h, "fp16", with_scale=False), ops_lib).run(None, feeds)[0]
    for kv, tol in (("int8", 0.03), ("fp8", 0.15)):
        got = _session(_model(h, kv), ops_lib).run(None, _quantize_case(rng, feeds, kv, fit=True))[0]
        err = np.abs(got[real].astype(np.float32) - fp16[real].astype(np.float32)).max()
        assert 0 < err <= tol, (kv, err)


@pytest.mark.parametrize("kv,with_scale,message", [
    ("int8", False, "int8 pools hold codes and need kv_scale"),
    ("fp8", False, "uint8 pools hold codes and need kv_scale"),
    ("fp16", True, "kv_scale is for int8 / uint8"),
])
def test_scales_go_with_quantized_pools(ops_lib, kv, with_scale, message):
    rng = np.random.default_rng(0)
    feeds, _ = _case(rng, 1, 4, 64, 16, [5])
    if kv in POOL:
        feeds = _quantize_case(rng, feeds, kv)
        if not with_scale:
            feeds.pop("kv_scale")
    else:
        feeds["kv_scale"] = np.ones((2, HKV, 64), np.float32)
    with pytest.raises(Exception, match=message):
        _session(_model(4, kv, with_scale), ops_lib).run(None, feeds)


def test_bad_scale_shape_is_named(ops_lib):
    rng = np.random.default_rng(0)
    feeds, _ = _case(rng, 1, 4, 64, 16, [5])
    feeds = _quantize_case(rng, feeds, "int8")
    feeds["kv_scale"] = feeds["kv_scale"][:, :, :32].copy()
    with pytest.raises(Exception, match=r"kv_scale must be float32 \[2, kv_num_heads = 2, head_size = 64\]"):
        _session(_model(4, "int8"), ops_lib).run(None, feeds)


# ----------------------------------------------------------------------------- GPU

# (B, S, G, D, BS, longest past): decode and chunks; 4k contexts split the keys.
GPU_CASES = [
    (1, 1, 4, 128, 16, 4000),
    (3, 1, 1, 64, 32, 4000),
    (1, 16, 4, 128, 16, 4000),
    (4, 5, 4, 64, 64, 1500),
    (64, 1, 4, 128, 16, 1000),
    (16, 16, 1, 128, 16, 200),
    (2, 16, 8, 64, 16, 600),  # G * S = 128 rows: several row blocks per KV head
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("b,s,g,d,bs,past", GPU_CASES)
def test_cuda_matches_cpu(ops_lib, kv, b, s, g, d, bs, past):
    """CUDA against the CPU kernel: the codes written are the same bits (both encode x / scale with IEEE
    division and the same rounding), the outputs close (the kernel rounds q * k_scale and the
    probabilities to fp16 for its MMAs)."""
    rng = np.random.default_rng(b * 100 + s + d + bs + len(kv))
    pasts = [int(x) for x in rng.integers(0, past + 1, b)]
    pasts[0] = past
    reals = [s] + [int(x) for x in rng.integers(1, s + 1, b - 1)] if s > 1 else None
    feeds, real = _case(rng, s, g * HKV, d, bs, pasts, reals)
    feeds = _quantize_case(rng, feeds, kv)
    model = _model(g * HKV, kv)
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda="user")
    for _ in range(2):
        got = cuda.run(None, feeds)
        _close(got[0], want[0], real)
        assert np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2])
