"""The --quant presets, named once: each name and the pass pipeline it stands for.

    --quant / BuildConfig.quant   a key of PRESETS (the CLI's choices)
    PRESETS[name]                 pipeline text (passes/manager/steps.py's syntax) with {block_size} and
                                  {smoothing} filled in by passes/manager/presets.py

A new preset is one row here (and its case in tests/passes/test_registry.py). The table is plain data in
core/ so that the CLI can offer the names without importing the passes (onnx, onnxruntime).
"""

from __future__ import annotations

PRESETS: dict[str, str] = {
    "w8a8-naive": "quantize_w8a8",
    "w8a8-sq": "smoothquant:{smoothing},quantize_w8a8",
    "w4a16-rtn": "quantize_w4a16:block_size={block_size}",
    "w4a16-awq": "awq:block_size={block_size},awq_clip:block_size={block_size},"
                 "quantize_w4a16:block_size={block_size}",
    "w4a16-gptq": "gptq:block_size={block_size}",
    "w4a16-gptq-asym": "gptq:block_size={block_size}:symmetric=false",
}
