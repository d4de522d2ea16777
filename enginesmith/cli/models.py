"""`enginesmith models`: the supported model families and what each supports (quantization passes,
KV layouts, CUDA attention ops), read from models/families.py, the one table that says so.

    enginesmith models            a table (one row per family; "no" rows name their reason below it)
    enginesmith models --json     the same as JSON: {family: {architecture, rope_types, features, tiny, support}}
"""

from __future__ import annotations

import json

from enginesmith.models.families import CUDA_OPS, FAMILIES, FEATURES, KV_LAYOUTS, PASSES, Family, support

COLUMNS = PASSES + KV_LAYOUTS + CUDA_OPS
SHORT = {"GroupQueryAttention": "gqa", "enginesmith.GroupQueryAttention": "es-gqa",
         "enginesmith.PagedGroupQueryAttention": "paged-gqa"}


def add_parser(verbs) -> None:
    p = verbs.add_parser("models", help="the supported model families and what each supports",
                         description="List the model families enginesmith exports, and for each the passes, KV "
                                     "layouts and CUDA ops it supports (a 'no' comes with its reason).")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_models)


def as_json() -> dict:
    return {f.name: {"model_type": f.model_type, "architecture": f.architecture, "rope_types": list(f.rope_types),
                     "features": list(f.features), "optional_features": list(f.optional),
                     "tiny": [f"tiny:{t}" for t in f.tiny], "support": support(f)} for f in FAMILIES.values()}


def _cell(verdict: str) -> str:
    return "yes" if verdict == "yes" else ("yes*" if verdict.startswith("yes") else "no")


def table() -> str:
    """The text table: a row per family, a footnote per "no" (and per "yes*": not with an optional feature)."""
    heads = ["family", "architecture"] + [SHORT.get(c, c) for c in COLUMNS]
    rows, notes, limits = [], [], []
    for f in FAMILIES.values():
        verdicts = support(f)
        rows.append([f.name, f.architecture] + [_cell(verdicts[c]) for c in COLUMNS])
        for c in COLUMNS:
            v = verdicts[c]
            if v.startswith("no"):
                notes.append(f"  {f.name} {SHORT.get(c, c)}: {v.removeprefix('no: ')}")
            elif v != "yes":  # "yes (not with ...)": the yes* cells
                limits.append(f"  {f.name} {SHORT.get(c, c)}: {v.removeprefix('yes (').removesuffix(')')}")
    widths = [max(len(r[i]) for r in [heads] + rows) for i in range(len(heads))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [heads] + rows]
    lines += ["", "Features:"] + [f"  {f.name}: {_features(f)}" for f in FAMILIES.values()]
    lines += ["", "Supported with limits (yes*):"] + limits if limits else []
    return "\n".join(lines + (["", "Not supported (why):"] + notes if notes else []))


def _features(f: Family) -> str:
    parts = [FEATURES[x] for x in f.features] + [f"optional: {FEATURES[x]}" for x in f.optional]
    rope = "" if f.rope_types == ("default",) else f"; rope_type {' or '.join(f.rope_types)}"
    return ("; ".join(parts) or "plain pre-norm decoder") + rope


def cmd_models(args) -> int:
    print(json.dumps(as_json(), indent=2) if args.json else table())
    return 0
