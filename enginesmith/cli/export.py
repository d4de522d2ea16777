"""`enginesmith export`: a model to ONNX with KV-cache inputs/outputs (weights in <out>.data).

Both files are written under temp names in a folder beside --out and renamed into place, so the graph
reads `<out name>.data`; an existing --out (or its .data) is replaced only with --force, and only when
it is a regular file (core.out_paths)."""

from __future__ import annotations

import sys

from enginesmith.cli.flags import add_model_flags
from enginesmith.core.engine_dir import graph_pair_atomically
from enginesmith.core.out_paths import check_new_file, check_out
from enginesmith.models import load as models


def add_parser(verbs) -> None:
    p = verbs.add_parser("export", help="export a model to ONNX with KV-cache inputs/outputs")
    add_model_flags(p, engine=False)
    p.add_argument("--out", required=True, help="output .onnx path (weights go to <out>.data)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--opset", type=int, default=23)
    p.add_argument("--force", action="store_true", help="replace an existing --out file and its .data file")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    from enginesmith.export.to_onnx import export  # deferred: imports torch (~2 s), which --help must not pay

    out = check_out(args.out, "--out", "file")  # before minutes of loading and tracing
    for p in (out, out.with_name(out.name + ".data")):
        check_out(p, "--out", "file")
        check_new_file(p, "--out", args.force)
    loaded = models.load(args.model)
    print(f"Exporting {loaded.source.name} ({loaded.family.architecture}) to {out} ...", file=sys.stderr)
    with graph_pair_atomically(out, args.force) as tmp:
        export(loaded.model, tmp, dtype=args.dtype, opset=args.opset)
    print(out)
    return 0
