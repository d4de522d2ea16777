"""Named passes with typed parameters, pipeline specs and presets.

A pass is a function `fn(model: ir.Model, params, ctx: PassContext) -> PassResult` registered with
a name, a frozen dataclass of parameters (validated in `__post_init__`), whether it is exact (the
pass manager then compares the graph's outputs before and after) or lossy (measured by evaluation
instead), and whether it needs calibration data; either may depend on the parameters. Pipelines are
written as text:

    smoothquant:alpha=0.5,quantize_w8a8
    awq:block_size=64,grid=10,quantize_w4a16:block_size=64,lower_ort:accuracy_level=0

Steps are separated by commas; `name:key=value` starts a step and a following `key=value` without
a colon adds a parameter to the step before it.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from enginesmith.core.errors import UserError
from enginesmith.passes.analysis import calibrate
from enginesmith.passes.machinery.match import Rejection

# Modules of this package that only hold machinery, not passes (every other module is imported by
# `passes()`, so a new pass module registers itself by being there).
MACHINERY = {"calibrate", "dense_attention", "edit", "fold", "hessian", "kv_calibrate", "linears", "match", "paged_lower", "paged_rewrite",
             "paged_verify", "pipeline", "qmath", "registry", "ring_rope", "ring_verify", "sites", "verify"}


@dataclass
class PassResult:
    counts: dict[str, int] = field(default_factory=dict)
    skipped: list[Rejection] = field(default_factory=list)  # what the pass left alone, and why
    details: list[dict] = field(default_factory=list)       # per-site choices (alpha, scales, ...)


@dataclass
class PassContext:
    """What a pass may ask of the manager: the graph file it is working from and calibration."""

    model_path: Path
    calibration: Any = None  # CalibrationSet | None
    progress: bool = True
    _stats: dict = field(default_factory=dict)

    def stats(self, names: list[str]) -> dict:
        """Activation statistics (calibrate.ActStats) of `names` in the graph at `model_path`."""
        if self.calibration is None:
            raise UserError("this pipeline needs calibration data", "pass a calibration set")
        missing = [n for n in names if n not in self._stats]
        if missing:
            self._stats.update(calibrate.collect(self.model_path, missing, self.calibration,
                                                 progress=self.progress))
        return {n: self._stats[n] for n in names}


@dataclass(frozen=True)
class PassInfo:
    name: str
    params: type
    fn: Callable[..., PassResult]
    exact: bool | Callable[[Any], bool]        # or a function of the params
    calibrated: bool | Callable[[Any], bool]   # or a function of the params
    doc: str

    def is_exact(self, params) -> bool:
        return bool(self.exact(params) if callable(self.exact) else self.exact)

    def needs_calibration(self, params) -> bool:
        return bool(self.calibrated(params) if callable(self.calibrated) else self.calibrated)


REGISTRY: dict[str, PassInfo] = {}


def register(name: str, params: type, exact: bool | Callable[[Any], bool],
             calibrated: bool | Callable[[Any], bool] = False):
    """Decorator: make `fn` the pass `name`."""
    def wrap(fn):
        REGISTRY[name] = PassInfo(name, params, fn, exact, calibrated, (fn.__doc__ or "").strip())
        return fn
    return wrap


def passes() -> dict[str, PassInfo]:
    """Every registered pass, after importing every pass module of this package."""
    import pkgutil

    import enginesmith.passes as package  # deferred: the package imports this module (a cycle at import time)

    for info in pkgutil.walk_packages(package.__path__, prefix="enginesmith.passes."):
        leaf = info.name.rsplit(".", 1)[1]
        if not info.ispkg and leaf not in MACHINERY and not leaf.startswith("_"):
            importlib.import_module(info.name)
    return REGISTRY


@dataclass(frozen=True)
class Step:
    name: str
    params: Any  # the pass's params dataclass instance

    def spec(self) -> str:
        """`name:key=value,...` with the parameters that differ from their defaults."""
        default = passes()[self.name].params()
        changed = [f"{f.name}={_format(getattr(self.params, f.name))}"
                   for f in dataclasses.fields(self.params)
                   if getattr(self.params, f.name) != getattr(default, f.name)]
        return self.name + (":" + ",".join(changed) if changed else "")

    def to_json(self) -> dict:
        return {"name": self.name, "params": dataclasses.asdict(self.params)}


def calibrated_steps(steps: list[Step]) -> list[Step]:
    """The steps that need calibration data, given their parameters."""
    table = passes()
    return [s for s in steps if table[s.name].needs_calibration(s.params)]


def _format(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _convert(pass_name: str, key: str, text: str, kind) -> Any:
    try:
        if kind is bool:
            lowered = text.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return lowered in ("true", "1", "yes")
        return kind(text)
    except ValueError:
        raise UserError(f"{pass_name}: {key}={text!r} is not a valid {kind.__name__}",
                        f"give {key} a {kind.__name__} value") from None


def make_step(name: str, params: dict[str, str] | None = None) -> Step:
    """A Step from a pass name and textual parameters (validated by the params dataclass)."""
    table = passes()
    if name not in table:
        raise UserError(f"unknown pass {name!r}", f"use one of: {', '.join(sorted(table))}")
    cls = table[name].params
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, text in (params or {}).items():
        if key not in fields:
            raise UserError(f"pass {name!r} has no parameter {key!r}",
                            f"its parameters are: {', '.join(sorted(fields)) or 'none'}")
        values[key] = _convert(name, key, text, hints[key])
    return Step(name, cls(**values))


def parse_pipeline(text: str) -> list[Step]:
    """Steps from `smoothquant:alpha=0.5,quantize_w8a8`-style text (see the module doc)."""
    steps: list[tuple[str, dict[str, str]]] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        if ":" in token:
            name, _, first = token.partition(":")
            steps.append((name.strip(), {}))
            token = first
        elif "=" not in token:
            steps.append((token, {}))
            continue
        elif not steps:
            raise UserError(f"pipeline {text!r} starts with a parameter ({token})",
                            "write name:key=value, e.g. smoothquant:alpha=0.5")
        for item in filter(None, (t.strip() for t in token.split(":"))):
            key, eq, value = item.partition("=")
            if not eq:
                raise UserError(f"parameter {item!r} of pass {steps[-1][0]!r} has no value",
                                "write key=value")
            steps[-1][1][key.strip()] = value.strip()
    if not steps:
        raise UserError("the pass pipeline is empty", "name at least one pass, e.g. quantize_w8a8")
    return [make_step(name, params) for name, params in steps]


PRESETS: dict[str, str] = {
    "w8a8-naive": "quantize_w8a8",
    "w8a8-sq": "smoothquant:{smoothing},quantize_w8a8",
    "w4a16-rtn": "quantize_w4a16:block_size={block_size}",
    "w4a16-awq": "awq:block_size={block_size},awq_clip:block_size={block_size},"
                 "quantize_w4a16:block_size={block_size}",
    "w4a16-gptq": "gptq:block_size={block_size}",
    "w4a16-gptq-asym": "gptq:block_size={block_size}:symmetric=false",
}
LOWERING: dict[str, str] = {"ort": "lower_ort:accuracy_level={accuracy_level}", "trt": ""}


def preset_steps(preset: str, block_size: int = 128, alpha: float | None = None) -> list[Step]:
    """The steps of a preset (`w8a8-naive`, `w8a8-sq`, `w4a16-rtn`, `w4a16-awq`, `w4a16-gptq`,
    `w4a16-gptq-asym`). SmoothQuant's
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
