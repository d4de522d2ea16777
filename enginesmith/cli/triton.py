"""`enginesmith triton`: a Triton Inference Server model repository for an engine.

The flags and the work live in serving.triton_repository (which also runs as a script); this module
puts them under the `enginesmith` command."""

from __future__ import annotations

from enginesmith.serving import triton_repository


def add_parser(verbs) -> None:
    p = verbs.add_parser("triton", help="write a Triton Inference Server model repository for an engine")
    triton_repository.add_arguments(p)
    p.set_defaults(func=cmd_triton)


def cmd_triton(args) -> int:
    return triton_repository.run(args)
