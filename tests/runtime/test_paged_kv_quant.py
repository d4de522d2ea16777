"""The CUDA paged engine with quantized KV pages (`build --for-cuda --kv paged --kv-dtype int8|fp8`),
run on the CPU through the ORT ops' CPU kernels: the build calibrates per-channel scales into the
graph, the runtime allocates int8 / uint8 pools (half the bytes per page), and the logits stay close to
the fp16-KV engine's on the same steps.

Tolerance: tiny:llama-hd64 (random weights, 2 layers) on 40 tokens of Pride and Prejudice in chunks
of 16; its logits have a spread (std) of ~0.64. Measured against the fp16 pages: int8 max |diff|
0.047, rms 0.007; fp8 (3 mantissa bits) max 0.11, rms 0.018. The bounds below leave about 2x.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers.kv_quant_checks import LOGIT_TOLERANCES, assert_close_to_fp16, austen_tokens

CAPACITY = 256
PAGE = 16
TOKENS = 40


@pytest.fixture(scope="module")
def engines(ort_ops_lib, austen, tmp_path_factory):
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    root = tmp_path_factory.mktemp("paged_kv")
    yield {kv: build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=CAPACITY, kv_layout="paged",
                                 page_size=PAGE, max_batch=4, kv_dtype=kv, calib_samples=4), root / kv, source=src,
                                 progress=False)
           for kv in ("fp16", "int8", "fp8")}
    mp.undo()


def _prompt(path) -> np.ndarray:
    return austen_tokens(path, 1000, TOKENS)


def _logits(path, prompt):
    """Logits [TOKENS, V] of one row fed in chunks of PAGE columns over pages 1, 2, 3 (and the pool)."""
    from enginesmith.runtime.engines.paged_cuda import open_paged_engine

    eng = open_paged_engine(path, device="cpu", max_batch=2, num_pages=16).engine
    tables = np.zeros((1, eng.max_blocks), np.int32)
    tables[0, :4] = np.arange(1, 5)
    out = []
    for start in range(0, TOKENS, PAGE):
        pos = start + np.arange(min(PAGE, TOKENS - start))
        slots = (tables[0, pos // PAGE] * PAGE + pos % PAGE)[None].astype(np.int32)
        out.append(eng._plain(eng.kv, prompt[None, pos], tables, np.array([pos[-1] + 1], np.int32), slots)
                   .float().numpy()[0])
    return eng, np.concatenate(out)


def test_build_records_the_pages_format(engines):
    import onnx

    for kv, pool_type in (("int8", onnx.TensorProto.INT8), ("fp8", onnx.TensorProto.UINT8)):
        manifest = json.loads((engines[kv] / "build.json").read_text())
        assert manifest["kv_layout"]["kv_dtype"] == kv
        graph = onnx.load(str(engines[kv] / "model.onnx"), load_external_data=False).graph
        pools = [i for i in graph.input if i.name.startswith("past_key_values")]
        assert pools and all(i.type.tensor_type.elem_type == pool_type for i in pools)
        nodes = [n for n in graph.node if n.op_type == "PagedGroupQueryAttention"]
        assert nodes and all(len(n.input) == 9 for n in nodes)  # + kv_scale
    assert "kv_dtype" not in json.loads((engines["fp16"] / "build.json").read_text())["kv_layout"]


@pytest.mark.parametrize("kv,max_tol,rms_tol", LOGIT_TOLERANCES)
def test_quantized_pages_logits_close_to_fp16(engines, kv, max_tol, rms_tol):
    prompt = _prompt(engines["fp16"])
    ref_engine, ref = _logits(engines["fp16"], prompt)
    engine, got = _logits(engines[kv], prompt)
    assert engine.kv.element_size() == 1 and ref_engine.kv.element_size() == 2
    assert engine.page_bytes * 2 == ref_engine.page_bytes  # twice the tokens per byte
    assert_close_to_fp16(got, ref, max_tol, rms_tol)


def test_kv_dtype_needs_the_cuda_paged_engine():
    from enginesmith.builder.engine import BuildConfig
    from enginesmith.core.errors import UserError

    with pytest.raises(UserError, match="--kv-dtype int8 quantizes the pages of the CUDA paged engine"):
        BuildConfig(model="tiny:llama", kv_dtype="int8")
    with pytest.raises(UserError, match="unknown KV page format --kv-dtype int4"):
        BuildConfig(model="tiny:llama", target="ort-cuda", dtype="fp16", kv_layout="paged", kv_dtype="int4")
