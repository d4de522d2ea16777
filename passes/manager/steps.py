"""Every registered pass, and pipeline steps from text: `smoothquant:alpha=0.5,quantize_w8a8`.

`passes()` imports every module of the pass folders, so a new pass module registers itself by being
there; the text syntax is machinery/registry.py's module doc.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from typing import Any

from enginesmith.core.errors import UserError
from enginesmith.passes.machinery.registry import REGISTRY, PassInfo, Step

# The folders whose modules may register passes (analysis/ and machinery/ hold none); every module in
# them is imported, helpers too (importing one registers nothing).
PASS_FOLDERS = ("fusion", "quant", "lower", "kv")


def passes() -> dict[str, PassInfo]:
    """Every registered pass, after importing every module of the pass folders."""
    for folder in PASS_FOLDERS:
        package = importlib.import_module(f"enginesmith.passes.{folder}")
        for info in pkgutil.iter_modules(package.__path__, prefix=f"{package.__name__}."):
            if not info.ispkg and not info.name.rsplit(".", 1)[1].startswith("_"):
                importlib.import_module(info.name)
    return REGISTRY


def calibrated_steps(steps: list[Step]) -> list[Step]:
    """The steps that need calibration data, given their parameters."""
    table = passes()
    return [s for s in steps if table[s.name].needs_calibration(s.params)]


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
