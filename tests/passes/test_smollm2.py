"""The passes on the real SmolLM2 graph (slow: a 540 MB graph, calibration on real text).

Set ENGINESMITH_TEST_SMOLLM2_ONNX to an fp32 opset-23 export to skip building one.
"""

from __future__ import annotations

import numpy as np
import pytest
from quant_helpers import ort_logits

from enginesmith.passes import build_pipeline, calibration_set, run_pipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small_calib(austen):
    from enginesmith.models.load import load_tokenizer, resolve

    return calibration_set(load_tokenizer(resolve(None)), samples=4, seq_len=128)


def _size(path) -> int:
    return path.stat().st_size + path.with_name(path.name + ".data").stat().st_size


def test_smoothquant_fold_is_exact_on_smollm2(smollm2_graph, small_calib, tmp_path):
    (entry,) = run_pipeline(smollm2_graph, tmp_path / "sq.onnx", "smoothquant:alpha=0.5",
                            calibration=small_calib, progress=False)
    assert entry["counts"] == {"sites": 120, "norm": 60, "attn_v": 30, "mlp_up": 30,
                               "linears_smoothed": 210, "linears_not_smoothed": 0}
    assert entry["max_diff"] <= entry["tolerance"]          # logits to fp32 tolerance, checked by ORT
    assert [r["reason"] for r in entry["skipped"]] == [
        "lm_head stays high precision (pass include_lm_head=true to quantize it)"]


def test_w4a16_awq_engine_on_smollm2(smollm2_graph, small_calib, tmp_path):
    """AWQ + int4 g128 + int8 embedding + MatMulNBits: size target, and still a language model.

    SmolLM2-135M loses a lot at int4 g128 (its GGUF weights already went through Q4_1 blocks of
    32): round-to-nearest agrees with fp32 on ~48 % of next-token argmaxes of this text; the
    accuracy comparison with RTN is the benchmark's job (benchmarks/quant/ppl_table.py)."""
    out = tmp_path / "w4.onnx"
    steps = build_pipeline("w4a16-awq", block_size=128, quantize_embeddings=True)
    report = run_pipeline(smollm2_graph, out, steps, calibration=small_calib, progress=False)
    by_name = {r["name"]: r for r in report}
    assert by_name["awq"]["max_diff"] <= by_name["awq"]["tolerance"]
    assert by_name["quantize_w4a16"]["counts"]["linears"] == 210
    assert by_name["lower_ort"]["counts"]["matmulnbits"] == 210
    fp16_bytes = _size(smollm2_graph) / 2                     # every fp32 tensor halves in fp16
    assert _size(out) <= 0.35 * fp16_bytes
    from enginesmith.models.corpus import austen_text
    from enginesmith.models.corpus import tokenize
    from enginesmith.models.load import load_tokenizer, resolve

    ids = tokenize(load_tokenizer(resolve(None)), austen_text("prideprejudice"))[None, :128]
    a, b = ort_logits(smollm2_graph, ids), ort_logits(out, ids)
    assert np.mean(a.argmax(-1) == b.argmax(-1)) > 0.45
