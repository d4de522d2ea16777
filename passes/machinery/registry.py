"""Named passes with typed parameters: what a pass module registers, and a pipeline step.

A pass is a function `fn(model: ir.Model, params, ctx: PassContext) -> PassResult` registered with
a name, a frozen dataclass of parameters (validated in `__post_init__`), whether it is exact (the
pass manager then compares the graph's outputs before and after) or lossy (measured by evaluation
instead), and whether it needs calibration data; either may depend on the parameters. Pipelines are
written as text:

    smoothquant:alpha=0.5,quantize_w8a8
    awq:block_size=64,grid=10,quantize_w4a16:block_size=64,lower_ort:accuracy_level=0

Steps are separated by commas; `name:key=value` starts a step and a following `key=value` without
a colon adds a parameter to the step before it. This module holds the table passes register into;
finding every pass, reading pipeline text and the presets are the manager's (passes/manager/steps.py,
presets.py): the machinery imports no pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from enginesmith.core.errors import UserError
from enginesmith.passes.machinery.match import Rejection


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
        """Activation statistics (calibrate.ActStats) of `names` in the graph at `model_path`, which the
        calibration set collects (CalibrationSet.activation_stats)."""
        if self.calibration is None:
            raise UserError("this pipeline needs calibration data", "pass a calibration set")
        missing = [n for n in names if n not in self._stats]
        if missing:
            self._stats.update(self.calibration.activation_stats(self.model_path, missing, progress=self.progress))
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


@dataclass(frozen=True)
class Step:
    name: str
    params: Any  # the pass's params dataclass instance

    def spec(self) -> str:
        """`name:key=value,...` with the parameters that differ from their defaults."""
        default = type(self.params)()
        changed = [f"{f.name}={_format(getattr(self.params, f.name))}"
                   for f in dataclasses.fields(self.params)
                   if getattr(self.params, f.name) != getattr(default, f.name)]
        return self.name + (":" + ",".join(changed) if changed else "")

    def to_json(self) -> dict:
        return {"name": self.name, "params": dataclasses.asdict(self.params)}


def _format(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
