"""Quantization presets and the pipeline `enginesmith build` runs (a preset, explicit passes, the lowering)."""

from __future__ import annotations

from enginesmith.core.errors import UserError
from enginesmith.core.quant_spec import PRESETS
from enginesmith.passes.manager.steps import Step, make_step, parse_pipeline

LOWERING: dict[str, str] = {"ort": "lower_ort:accuracy_level={accuracy_level}", "trt": ""}


def preset_steps(preset: str, block_size: int = 128, alpha: float | None = None) -> list[Step]:
    """The steps of a preset (a name of core/quant_spec.py's PRESETS). SmoothQuant's
    alpha is searched per site unless `alpha` fixes one for the whole model (on SmolLM2 the search
    closes 98 % of naive W8A8's perplexity gap, alpha = 0.5 closes 78 %)."""
    if preset not in PRESETS:
        raise UserError(f"unknown quantization preset {preset!r}", f"use one of: {', '.join(PRESETS)}")
    smoothing = "search=true" if alpha is None else f"alpha={alpha}"
    return parse_pipeline(PRESETS[preset].format(block_size=block_size, smoothing=smoothing))


def build_pipeline(quant: str | None = None, passes_text: str | None = None, block_size: int = 128,
                   alpha: float | None = None, quantize_embeddings: bool = False, backend: str = "ort",
                   accuracy_level: int = 0) -> list[Step]:
    """What `enginesmith build` runs: a preset and/or explicit passes, then the backend lowering.

    `quantize_embeddings` adds `quantize_embedding` (int8 table shared with a tied lm_head)."""
    steps = preset_steps(quant, block_size, alpha) if quant else []
    if passes_text:
        steps += parse_pipeline(passes_text)
    if quantize_embeddings:
        steps.append(make_step("quantize_embedding"))
    if backend not in LOWERING:
        raise UserError(f"unknown backend {backend!r}", f"use one of: {', '.join(LOWERING)}")
    lowering = LOWERING[backend].format(accuracy_level=accuracy_level)
    if steps and lowering and not any(s.name == "lower_ort" for s in steps):
        steps += parse_pipeline(lowering)
    return steps
