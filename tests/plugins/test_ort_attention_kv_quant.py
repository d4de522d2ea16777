"""com.enginesmith.GroupQueryAttention (plugins/ort_ops/attention.h) over quantized dense KV buffers:
int8 caches, and uint8 caches of fp8 e4m3 codes, with static channel scales kv_scale [2, Hkv, D] (the
paged op's layout and codes: plugins/paged_attention/kv_quant.h).

CPU (here and in CI): the op's CPU kernel against the numpy reference that encodes and decodes the same
way (plugins/reference.py group_query_attention with kv_scale, reusing kv_encode / kv_decode): the codes
written are the same bits, the outputs close; decode and S > 1, softcap and windows, head sizes 64, 128
and 256; the output against the fp16 caches' within the quantization error; the scales' and caches'
types checked with named errors.
GPU (marked gpu): the CUDA kernel (codes widened in its loads, K's scales folded into q and V's into the
output; the new tokens' K/V encoded as written) against the CPU kernel: the same codes bit for bit, the
outputs close; decode with split keys, verification and prompt shapes (prompts of quantized caches run
on the decode kernel, also with $ES_GQA_PREFILL=1), on ORT's stream and a user stream.

Legend: B rows, S new tokens per row, H / Hkv heads, D head size, C capacity.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto as T  # noqa: E402
from onnx import helper  # noqa: E402

from plugin_modules import reference  # noqa: E402
from test_ort_attention import INPUTS, _feeds, _options, _pass_model  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402

CACHE = {"int8": (np.int8, T.INT8), "fp8": (np.uint8, T.UINT8), "fp16": (np.float16, T.FLOAT16)}
CODE_MAX = {"int8": 127.0, "fp8": 448.0}
OUTPUTS = ["out", "present_key", "present_value"]


def _model(h: int, hkv: int, kv: str, with_scale: bool = True, **options):
    """One com.enginesmith.GroupQueryAttention over `kv` caches (+ kv_scale); options: softcap, local_window_size."""
    cache = CACHE[kv][1]
    names = INPUTS + (["kv_scale"] if with_scale else [])
    node = helper.make_node("GroupQueryAttention", names, OUTPUTS, domain="com.enginesmith", num_heads=h,
                            kv_num_heads=hkv, scale=float(1.0 / np.sqrt(64)), **options)

    def type_of(n):
        return {"past_key": cache, "past_value": cache, "seqlens_k": T.INT32, "total_sequence_length": T.INT32,
                "kv_scale": T.FLOAT}.get(n, T.FLOAT16)

    inputs = [helper.make_tensor_value_info(n, type_of(n), [] if n == "total_sequence_length" else None) for n in names]
    outputs = [helper.make_tensor_value_info(n, T.FLOAT16 if n == "out" else cache, None) for n in OUTPUTS]
    return helper.make_model(helper.make_graph([node], "g", inputs, outputs), ir_version=10, opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.enginesmith", 1)])


def _bounds(feeds, hkv: int):
    """K's and V's channel bounds [2, Hkv, D] of the caches and the new tokens, as the pass calibrates them
    (the new keys' rotation-invariant pair norm, values' absmax)."""
    d = feeds["past_key"].shape[-1]
    new = feeds["qkv"].astype(np.float32).reshape(-1, feeds["qkv"].shape[-1] // d, d)[:, -2 * hkv:]
    k, v = new[:, :hkv], new[:, hkv:]
    pair = np.sqrt(k[..., :d // 2] ** 2 + k[..., d // 2:] ** 2).max(0)
    cached = [np.abs(feeds[n].astype(np.float32)).max(axis=(0, 2)) for n in ("past_key", "past_value")]  # [Hkv, D]
    return np.stack([np.maximum(cached[0], np.concatenate([pair, pair], -1)), np.maximum(cached[1], np.abs(v).max(0))])


def _quantize(rng, feeds, hkv: int, kv: str, fit: bool = False):
    """The fp16 caches -> codes, plus kv_scale [2, Hkv, D]: at random channel bounds (values beyond
    saturate), or with `fit` at the data's bounds."""
    d = feeds["past_key"].shape[-1]
    bound = _bounds(feeds, hkv) if fit else np.full((2, hkv, d), 2.5, np.float32) * rng.uniform(0.5, 1.5, (2, hkv, d))
    scale = (bound / CODE_MAX[kv]).astype(np.float32)
    out = dict(feeds, kv_scale=scale)
    for which, name in enumerate(("past_key", "past_value")):  # kv_encode takes [..., Hkv, D]
        out[name] = np.ascontiguousarray(
            reference.kv_encode(feeds[name].transpose(0, 2, 1, 3), scale[which], CACHE[kv][0]).transpose(0, 2, 1, 3))
    return out


def _numpy(feeds, h, hkv, softcap=0.0, window=-1):
    return reference.group_query_attention(
        feeds["qkv"], feeds["past_key"], feeds["past_value"], feeds["seqlens_k"], feeds["cos_cache"],
        feeds["sin_cache"], h, hkv, 1.0 / np.sqrt(64), softcap=softcap, local_window_size=window,
        kv_scale=feeds.get("kv_scale"))


def _close(got, want):
    """Outputs close (the same decoded values, fp32 scores, sums in another order); caches equal: the same
    codes bit for bit where written, the input's elsewhere."""
    out, w_out = got[0].astype(np.float32), want[0].astype(np.float32)
    assert np.isfinite(out).all()
    err = float(np.abs(out - w_out).max())
    assert err <= 2e-3 * max(1.0, float(np.abs(w_out).max())), err
    assert got[1].dtype == want[1].dtype and np.array_equal(got[1], want[1])
    assert np.array_equal(got[2], want[2])


# (B, S, H, Hkv, D, capacity, pasts, softcap, window): decode, verification, prompts with and without a
# past, rows of different lengths, options, head sizes 64 / 128 / 256.
CASES = [
    (2, 1, 8, 2, 64, 64, [5, 30], 0.0, -1),
    (1, 1, 9, 3, 64, 48, [17], 0.0, -1),
    (1, 5, 6, 2, 128, 32, [0], 0.0, -1),
    (2, 3, 4, 4, 64, 40, [2, 10], 0.0, -1),
    (1, 4, 8, 2, 64, 64, [20], 2.0, 8),
    (1, 3, 8, 4, 256, 24, [12], 0.0, -1),
]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts,softcap,window", CASES)
def test_cpu_kernel_matches_numpy_reference(ops_lib, kv, b, s, h, hkv, d, cap, pasts, softcap, window):
    rng = np.random.default_rng(b * 100 + s * 10 + d + len(kv))
    feeds = _quantize(rng, _feeds(rng, b, s, h, hkv, d, cap, pasts), hkv, kv)
    got = _session(_model(h, hkv, kv, **_options(softcap, window)), ops_lib).run(None, feeds)
    want = _numpy(feeds, h, hkv, softcap, window)
    _close(got, want)
    for i, past in enumerate(pasts):  # only the new positions were written
        end = past + s
        for n, out in (("past_key", got[1]), ("past_value", got[2])):
            assert np.array_equal(out[i, :, :past], feeds[n][i, :, :past])
            assert np.array_equal(out[i, :, end:], feeds[n][i, :, end:])


def test_quantized_output_is_close_to_fp16(ops_lib):
    """The same data through fp16 caches and quantized caches with fitted scales: the output is the fp16
    one within the quantization error. Unit-normal data, bounds ~4.5: an int8 code step is ~0.035 (each
    value off by <= 0.018; outputs, weighted means of values, about that); fp8 keeps 3 mantissa bits,
    <= 1/16 of a value. (The paged op's test, the same bounds.)"""
    rng = np.random.default_rng(3)
    h, hkv, d = 8, 2, 64
    feeds = _feeds(rng, 2, 5, h, hkv, d, 96, [40, 70])
    fp16 = _session(_model(h, hkv, "fp16", with_scale=False), ops_lib).run(None, feeds)[0].astype(np.float32)
    for kv, tol in (("int8", 0.03), ("fp8", 0.15)):
        got = _session(_model(h, hkv, kv), ops_lib).run(None, _quantize(rng, feeds, hkv, kv, fit=True))[0]
        err = np.abs(got.astype(np.float32) - fp16).max()
        assert 0 < err <= tol, (kv, err)


@pytest.mark.parametrize("kv,with_scale,message", [
    ("int8", False, "int8 caches hold codes and need kv_scale"),
    ("fp8", False, "uint8 caches hold codes and need kv_scale"),
    ("fp16", True, "kv_scale is for int8 / uint8"),
])
def test_scales_go_with_quantized_caches(ops_lib, kv, with_scale, message):
    rng = np.random.default_rng(0)
    feeds = _feeds(rng, 1, 1, 4, 2, 64, 16, [5])
    if kv == "fp16":
        feeds["kv_scale"] = np.ones((2, 2, 64), np.float32)
    else:
        feeds = _quantize(rng, feeds, 2, kv)
        if not with_scale:
            feeds.pop("kv_scale")
    with pytest.raises(Exception, match=message):
        _session(_model(4, 2, kv, with_scale), ops_lib).run(None, feeds)


def test_bad_scale_shape_is_named(ops_lib):
    rng = np.random.default_rng(0)
    feeds = _quantize(rng, _feeds(rng, 1, 1, 4, 2, 64, 16, [5]), 2, "int8")
    feeds["kv_scale"] = feeds["kv_scale"][:, :, :32].copy()
    with pytest.raises(Exception, match=r"kv_scale must be float32 \[2, kv_num_heads = 2, head_size = 64\]"):
        _session(_model(4, 2, "int8"), ops_lib).run(None, feeds)


@pytest.mark.parametrize("change,words", [
    (dict(d=96), "'gqa' (1 layers) is ONNX Runtime's GroupQueryAttention (head size 96 is not one of (64, 128, 256)), "
                 "which reads fp16 KV only"),
    (dict(), "cannot quantize the KV of attention 'gqa_es' (1 layers): past_key is not [B, Hkv, C, D]"),
])
def test_pass_refuses_layers_it_cannot_quantize_with_the_reason(change, words):
    """quantize_kv before any calibration: a layer ort_attention left to ORT (its reason carried), or one
    whose KV buffers are not static [B, Hkv, C, D] graph inputs, is refused with what to do."""
    from enginesmith.core.errors import UserError
    from enginesmith.passes.lower.lower_gqa import CAPACITY_KEY
    from enginesmith.passes.lower.ort_attention import ort_attention
    from enginesmith.passes.kv.ort_kv_quant import quantize_kv

    model = _pass_model(**change)
    ort_attention(model)
    model.metadata_props[CAPACITY_KEY] = "32"
    with pytest.raises(UserError) as info:
        quantize_kv(model)
    assert words in str(info.value) and "--custom-attention" in str(info.value)


# ----------------------------------------------------------------------------- GPU
# Long pasts split the keys (the last-block merge); S = 9 is a verification; S = 130 and 37 are prompts
# (quantized caches: on the decode kernel's query tiles); rows of one call have different lengths.
GPU_CASES = CASES + [
    (1, 1, 32, 8, 64, 4096, [3000], 0.0, -1),
    (1, 1, 32, 8, 128, 8192, [8000], 0.0, -1),
    (3, 1, 32, 8, 64, 2048, [1, 700, 2000], 0.0, -1),
    (2, 9, 32, 8, 64, 1024, [100, 900], 0.0, -1),
    (1, 130, 32, 8, 64, 256, [0], 0.0, -1),
    (1, 37, 9, 3, 64, 2048, [1000], 0.0, -1),
    (1, 1, 8, 4, 256, 4096, [4000], 0.0, -1),
    (1, 40, 32, 2, 64, 512, [0], 2.0, 8),
    (1, 1, 32, 8, 128, 4096, [3000], 50.0, 512),
]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("b,s,h,hkv,d,cap,pasts,softcap,window", GPU_CASES)
@pytest.mark.parametrize("stream", ["user", "ort"])
def test_cuda_kernel_matches_cpu_kernel(ops_lib, kv, b, s, h, hkv, d, cap, pasts, softcap, window, stream):
    rng = np.random.default_rng(b * 1000 + s * 10 + d + len(kv))
    feeds = _quantize(rng, _feeds(rng, b, s, h, hkv, d, cap, pasts), hkv, kv)
    model = _model(h, hkv, kv, **_options(softcap, window))
    want = _session(model, ops_lib).run(None, feeds)
    cuda = _session(model, ops_lib, cuda=stream)
    for _ in range(3):  # the split counters must come back to zero after every call
        _close(cuda.run(None, feeds), want)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_cuda_prompt_with_the_prefill_path_enabled(ops_lib, kv, monkeypatch):
    """$ES_GQA_PREFILL=1 sends fp16 prompts to the tensor-core path; quantized caches stay on the decode
    kernel (prefill_applies) and still match the CPU kernel."""
    monkeypatch.setenv("ES_GQA_PREFILL", "1")
    rng = np.random.default_rng(11)
    h, hkv, d = 32, 8, 128
    feeds = _quantize(rng, _feeds(rng, 1, 200, h, hkv, d, 512, [100]), hkv, kv)
    model = _model(h, hkv, kv)
    _close(_session(model, ops_lib, cuda="ort").run(None, feeds), _session(model, ops_lib).run(None, feeds))
