"""BuildConfig: one config per target, validated once; `steps` gives each target's one pass list."""

from __future__ import annotations

import hashlib
import json

import pytest

from enginesmith import __version__
from enginesmith.builder.engine import MAX_CUDA_BATCH, BuildConfig, steps
from enginesmith.core.errors import UserError


@pytest.mark.parametrize("kwargs, words", [
    (dict(target="tvm"), "unknown target 'tvm'"),
    (dict(target="ort-cuda"), "--dtype fp32"),
    (dict(target="ort-cuda", dtype="fp16", kv_layout="ring", quant="w8a8-sq"), "--kv ring, --quant w8a8-sq"),
    (dict(target="ort-cuda", dtype="fp16", passes="quantize_w8a8"), "--passes"),
    (dict(target="ort-cuda", dtype="fp16", preset="orin"), "--preset"),
    (dict(target="ort-cuda", dtype="fp16", trt=object()), "--backend trt"),
    (dict(target="ort-cuda", dtype="fp16", quantize_lm_head=True), "needs --quant w4a16-rtn"),
    (dict(target="ort-cuda", dtype="fp16", max_batch=MAX_CUDA_BATCH + 1), f"outside 1..{MAX_CUDA_BATCH}"),
    (dict(target="ort-cuda", dtype="fp16", custom_ops=False, custom_attention=True), "needs the custom ops"),
    (dict(max_batch=4), "--max-batch belongs to --for-cuda engines"),
    (dict(custom_attention=True), "--custom-attention belongs to --for-cuda"),
    (dict(preset="orin"), "TensorRT (Jetson) preset"),
    (dict(page_size=0), "--page-size 0"),
    (dict(target="ort-cuda", dtype="bf16", kv_layout="paged"), "paged attention op, which is fp16 (got --dtype bf16)"),
    (dict(target="ort-cuda", dtype="fp16", kv_layout="paged", custom_ops=False), "--kv paged needs the custom ops"),
    (dict(target="ort-cuda", dtype="fp16", kv_layout="paged", page_size=8), "--page-size 8 is not one the paged"),
    (dict(target="trt", kv_layout="paged", page_size=8), "page size 8 is not one the PagedAttention plugin supports"),
])
def test_each_refused_combination_says_what_and_why(kwargs, words):
    with pytest.raises(UserError) as info:
        BuildConfig(**kwargs)
    assert words in str(info.value)


def test_cuda_steps_are_one_list_ending_in_the_lowering():
    def names(config, max_positions=512):
        return [s.spec() for s in steps(config, max_positions)]

    plain = BuildConfig(target="ort-cuda", dtype="fp16", custom_ops=False)
    assert names(plain) == ["lower_gqa:capacity=512", "skip_rmsnorm", "matmul_transb"]
    assert names(BuildConfig(target="ort-cuda", dtype="bf16", capacity=128, custom_ops=False))[0] == \
        "lower_gqa:capacity=128"
    int4 = BuildConfig(target="ort-cuda", dtype="fp16", quant="w4a16-rtn", quantize_lm_head=True, custom_ops=False)
    assert [n.split(":")[0] for n in names(int4)] == ["lower_gqa", "skip_rmsnorm", "untie_lm_head", "quantize_w4a16",
                                                      "lower_ort", "matmul_transb"]
    ops = BuildConfig(target="ort-cuda", dtype="fp16", custom_ops=True, custom_attention=True)
    assert names(ops)[-2:] == ["ort_gemv", "ort_attention"]
    assert steps(BuildConfig()) == []  # a plain ort-cpu engine: the export alone


def test_paged_cuda_steps_end_with_the_custom_attention_and_paging():
    """--for-cuda --kv paged: the ops are required (not only when built), the attention paged last."""
    for ops in (None, True):
        paged = BuildConfig(target="ort-cuda", dtype="fp16", kv_layout="paged", page_size=32, custom_ops=ops)
        assert paged.needs_ort_ops
        assert [s.spec() for s in steps(paged, 512)][-3:] == ["ort_gemv", "ort_attention", "paged_gqa:page_size=32"]
    int4 = BuildConfig(target="ort-cuda", dtype="fp16", kv_layout="paged", quant="w4a16-rtn")
    assert [s.name for s in steps(int4, 512)][-5:] == ["lower_ort", "matmul_transb", "ort_gemv", "ort_attention",
                                                        "paged_gqa"]
    assert not BuildConfig(target="ort-cuda", dtype="fp16", custom_ops=False).needs_ort_ops
    assert not BuildConfig(kv_layout="paged").needs_ort_ops  # the CPU paged engine: standard ops


def test_paged_and_dense_cuda_builds_have_their_own_cache_keys():
    sha = "b" * 64
    dense = BuildConfig(target="ort-cuda", dtype="fp16")
    paged = [BuildConfig(target="ort-cuda", dtype="fp16", kv_layout="paged", page_size=n) for n in (16, 32)]
    assert len({dense.key(sha), *(c.key(sha) for c in paged)}) == 3
    assert paged[0].key(sha) != BuildConfig(kv_layout="paged", dtype="fp16").key(sha)  # the CPU paged engine


def test_targets_keep_the_cache_keys_of_the_backends():
    """ort-cpu and trt configs hash as the `backend` ones did (cached engines stay valid); ort-cuda differs."""
    sha = "a" * 64

    def old_key(**settings):
        text = json.dumps(dict(settings, passes=[]), sort_keys=True) + __version__
        return f"{sha[:16]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"

    assert BuildConfig().key(sha) == old_key(dtype="fp32", opset=23, backend="ort")
    assert BuildConfig(dtype="fp16").key(sha) == old_key(dtype="fp16", opset=23, backend="ort")
    assert BuildConfig(target="trt").key(sha) == old_key(dtype="fp32", opset=23, backend="trt")
    assert BuildConfig(target="trt").backend == "trt" and BuildConfig(target="ort-cuda", dtype="fp16").backend == "ort"
    assert BuildConfig(target="ort-cuda", dtype="fp16").key(sha) != BuildConfig(dtype="fp16").key(sha)
