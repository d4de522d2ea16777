"""enginesmith.passes: ONNX graph passes and the pass manager that runs them.

    from enginesmith.passes import build_pipeline, calibration_set, run_pipeline
    steps = build_pipeline(quant="w4a16-awq", block_size=128, backend="ort")
    report = run_pipeline("fp32/model.onnx", "out/model.onnx", steps,
                          calibration=calibration_set(tokenizer))

Folders, each importing only those below it (tests/test_layers.py holds the rule):

    manager/    steps (find passes, typed steps, pipeline text), presets, pipeline (run + verify + atomic write), verify
    kv/         KV cache layout and format: kv_ring, kv_h2o, kv_paged, paged_gqa, quantize_kv
    lower/      a backend's ops: lower_ort, lower_gqa, ort_attention, ort_gemv, lower_paged
    quant/      smoothquant, awq, awq_clip, gptq, quantize_w8a8, llm_int8, quantize_w4a16, sparsify, ...
    analysis/   calibrate, hessian, linears, sites, kv_calibrate       fusion/  fuse_attention, fuse_matmul, ...
    machinery/  registry (the table passes register into), match (the one pattern mechanism), edit

Any module of fusion/, quant/, lower/ or kv/ that registers a pass is found by `passes()`.
"""

from enginesmith.passes.analysis.calibrate import CalibrationSet, calibration_set, from_tokens
from enginesmith.passes.machinery.registry import Step
from enginesmith.passes.manager.pipeline import run_pipeline
from enginesmith.passes.manager.presets import PRESETS, build_pipeline, preset_steps
from enginesmith.passes.manager.steps import make_step, parse_pipeline, passes, typed_step
from enginesmith.passes.manager.verify import PassCheckError

__all__ = [
    "CalibrationSet", "PRESETS", "PassCheckError", "Step", "build_pipeline", "calibration_set",
    "from_tokens", "make_step", "parse_pipeline", "passes", "preset_steps", "run_pipeline", "typed_step",
]
