"""The dense CUDA engine with quantized KV buffers (`build --for-cuda --custom-attention --kv-dtype
int8|fp8`), run on the CPU through the ORT ops' CPU kernels: the build calibrates per-channel scales into
the graph (passes/kv/ort_kv_quant.py), the runtime allocates int8 / uint8 buffers (half the bytes),
and the logits stay close to the fp16-KV engine's on the same steps. Also: what the build refuses.

Tolerance: tests/runtime/test_paged_kv_quant.py's, for the same reason (the same model, text, calibration and
codes: the dense op decodes the values the paged op does): tiny:llama-hd64 (random weights, 2 layers) on
40 tokens of Pride and Prejudice, here in calls of 16, 16, 4 tokens then 4 single-token steps; its
logits have a spread (std) of ~0.64. Measured against the fp16-KV engine: int8 max |diff| 0.047, rms
0.0071; fp8 (3 mantissa bits) max 0.112, rms 0.018 (the paged engine's numbers to 3 digits). The bounds
leave about 2x.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.kv_quant_checks import LOGIT_TOLERANCES, assert_close_to_fp16, austen_tokens

from enginesmith.builder.engine import BuildConfig, steps
from enginesmith.core.errors import UserError

CAPACITY = 256
TOKENS = 40
CALLS = (16, 16, 4, 1, 1, 1, 1)  # tokens per call: prompt chunks, then decode steps


@pytest.fixture(scope="module")
def engines(ort_ops_lib, austen, tmp_path_factory):
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    root = tmp_path_factory.mktemp("dense_kv")
    yield {kv: build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=CAPACITY, custom_ops=True,
                                 custom_attention=True, kv_dtype=kv, calib_samples=4), root / kv, source=src,
                                 progress=False)
           for kv in ("fp16", "int8", "fp8")}
    mp.undo()


def _prompt(path) -> np.ndarray:
    return austen_tokens(path, 1000, TOKENS)


def _logits(path, prompt):
    """Logits [TOKENS, V] of one row fed in CALLS through the engine's fixed steps (GqaEngine.run_rows)."""
    from enginesmith.runtime.engines.ort_cuda import open_gqa_engine

    eng = open_gqa_engine(path, device="cpu", max_batch=1).engine
    cache = eng.new_cache(1)
    out, start = [], 0
    for n in CALLS:
        out.append(eng.run_rows(prompt[None, start:start + n], cache).float().numpy()[0])
        start += n
    return eng, np.concatenate(out)


def test_build_records_the_kv_format(engines):
    import onnx

    for kv, cache_type in (("int8", onnx.TensorProto.INT8), ("fp8", onnx.TensorProto.UINT8)):
        manifest = json.loads((engines[kv] / "build.json").read_text())
        assert manifest["kv_layout"]["kv_dtype"] == kv and manifest["kv_layout"]["type"] == "dense"
        assert manifest["pass_counts"]["quantize_kv"] == {"quantize_kv": 2}
        graph = onnx.load(str(engines[kv] / "model.onnx"), load_external_data=False).graph
        caches = [v for v in list(graph.input) + list(graph.output)
                  if v.name.startswith(("past_key_values", "present"))]
        assert len(caches) == 8 and all(v.type.tensor_type.elem_type == cache_type for v in caches)
        nodes = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
        assert nodes and all(n.domain == "com.enginesmith" and len(n.input) == 8 for n in nodes)  # + kv_scale
    assert "kv_dtype" not in json.loads((engines["fp16"] / "build.json").read_text())["kv_layout"]


@pytest.mark.parametrize("kv,max_tol,rms_tol", LOGIT_TOLERANCES)
def test_quantized_kv_logits_close_to_fp16(engines, kv, max_tol, rms_tol):
    prompt = _prompt(engines["fp16"])
    ref_engine, ref = _logits(engines["fp16"], prompt)
    engine, got = _logits(engines[kv], prompt)
    assert engine.kv.element_size() == 1 and ref_engine.kv.element_size() == 2
    assert engine.kv_bytes_per_token * 2 == ref_engine.kv_bytes_per_token  # twice the tokens per byte
    assert_close_to_fp16(got, ref, max_tol, rms_tol)


@pytest.mark.parametrize("kwargs,words", [
    (dict(target="ort-cuda", dtype="fp16", kv_dtype="int8"),
     "--kv-dtype int8 on a dense --for-cuda engine needs --custom-attention: ONNX Runtime's own"),
    (dict(target="ort-cuda", dtype="bf16", custom_attention=True, kv_dtype="fp8"), "which is fp16 (got --dtype bf16)"),
    (dict(kv_dtype="int8"), "or the KV buffers of a dense --for-cuda --custom-attention engine"),
])
def test_dense_kv_dtype_refusals_name_the_fix(kwargs, words):
    with pytest.raises(UserError) as info:
        BuildConfig(model="tiny:llama", **kwargs)
    assert words in str(info.value)


def test_dense_kv_dtype_steps_and_cache_keys():
    config = BuildConfig(target="ort-cuda", dtype="fp16", custom_attention=True, kv_dtype="fp8")
    assert [s.spec() for s in steps(config, 512)][-3:] == ["ort_gemv", "ort_attention", "quantize_kv:kv_dtype=fp8"]
    sha = "c" * 64
    keys = {BuildConfig(target="ort-cuda", dtype="fp16", custom_attention=True, kv_dtype=kv).key(sha)
            for kv in ("fp16", "int8", "fp8")}
    assert len(keys) == 3  # each format its own cached engine
