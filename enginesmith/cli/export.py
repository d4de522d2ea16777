"""`enginesmith export`: a model to ONNX with KV-cache inputs/outputs (weights in <out>.data)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enginesmith.cli.flags import add_model_flags
from enginesmith.models import load as models


def add_parser(verbs) -> None:
    p = verbs.add_parser("export", help="export a model to ONNX with KV-cache inputs/outputs")
    add_model_flags(p, engine=False)
    p.add_argument("--out", required=True, help="output .onnx path (weights go to <out>.data)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--opset", type=int, default=23)
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from enginesmith.export.to_onnx import export  # deferred: imports torch (~2 s), which --help must not pay

    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.tmp")
    loaded = models.load(args.model)
    print(f"Exporting {loaded.source.name} ({loaded.family.architecture}) to {out} ...", file=sys.stderr)
    try:
        export(loaded.model, tmp, dtype=args.dtype, opset=args.opset)
        os.replace(tmp.with_name(tmp.name + ".data"), out.with_name(out.name + ".data"))
        os.replace(tmp, out)
    finally:
        for f in (tmp, tmp.with_name(tmp.name + ".data")):
            f.unlink(missing_ok=True)
    print(out)
    return 0
