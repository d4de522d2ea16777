"""enginesmith.passes: ONNX graph passes and the pass manager that runs them.

    from enginesmith.passes import build_pipeline, calibration_set, run_pipeline
    steps = build_pipeline(quant="w4a16-awq", block_size=128, backend="ort")
    report = run_pipeline("fp32/model.onnx", "out/model.onnx", steps,
                          calibration=calibration_set(tokenizer))

Modules: registry (names, params, presets, pipeline text), pipeline (run + verify + atomic write),
verify, calibrate, hessian (GPTQ's X^T X), match (the one pattern mechanism), linears, sites, fold,
qmath, edit, and the passes: smoothquant, awq, awq_clip, gptq, w8a8 (quantize_w8a8), llm_int8,
w4a16 (quantize_w4a16), embedding (quantize_embedding), kv_ring, kv_h2o, kv_paged, lower_ort
(+ lower_ort_int8). Any other module here that registers a pass
is found by `passes()`.
"""

from enginesmith.passes.analysis.calibrate import CalibrationSet, calibration_set, from_tokens
from enginesmith.passes.machinery.pipeline import run_pipeline
from enginesmith.passes.machinery.registry import (
    PRESETS,
    Step,
    build_pipeline,
    make_step,
    parse_pipeline,
    passes,
    preset_steps,
)
from enginesmith.passes.machinery.verify import PassCheckError

__all__ = [
    "CalibrationSet", "PRESETS", "PassCheckError", "Step", "build_pipeline", "calibration_set",
    "from_tokens", "make_step", "parse_pipeline", "passes", "preset_steps", "run_pipeline",
]
