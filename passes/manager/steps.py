"""Every registered pass, and pipeline steps: typed values from code, or text from the user.

    typed_step("kv_ring", sinks=4, window=1020)         # a pipeline code builds: values of the fields' types
    parse_pipeline("smoothquant:alpha=0.5,quantize_w8a8")  # --passes text: parsed through the fields' types

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


def _params_of(name: str, keys) -> tuple[type, dict[str, type]]:
    """The params dataclass of pass `name` and its fields' types, after checking `keys` are fields of it."""
    table = passes()
    if name not in table:
        raise UserError(f"unknown pass {name!r}", f"use one of: {', '.join(sorted(table))}")
    cls = table[name].params
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in keys:
        if key not in fields:
            raise UserError(f"pass {name!r} has no parameter {key!r}",
                            f"its parameters are: {', '.join(sorted(fields)) or 'none'}")
    return cls, hints


def make_step(name: str, params: dict[str, str] | None = None) -> Step:
    """A Step from a pass name and textual parameters (validated by the params dataclass)."""
    cls, hints = _params_of(name, params or {})
    return Step(name, cls(**{key: _convert(name, key, text, hints[key]) for key, text in (params or {}).items()}))


def typed_step(name: str, **values: Any) -> Step:
    """A Step from a pass name and parameter values of its params dataclass's field types, with no text
    between (a pipeline written in code). An int stands for a float (as 1 does for 1.0 in text); a bool
    is not an int, and a str is not a number: a value of another type is a TypeError, naming the field."""
    cls, hints = _params_of(name, values)
    checked = {}
    for key, value in values.items():
        kind = hints[key]
        if kind is float and type(value) is int:
            value = float(value)
        if type(value) is not kind:
            raise TypeError(f"pass {name!r}: {key} is of type {kind.__name__}, got {value!r} ({type(value).__name__})")
        checked[key] = value
    return Step(name, cls(**checked))


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
