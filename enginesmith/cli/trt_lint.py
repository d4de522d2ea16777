"""`enginesmith trt-lint`: check a graph against what a TensorRT version can parse.

The flags and the checks live in build.trt_lint (which also runs as a script); this module puts them
under the `enginesmith` command. Exit status 0 when clean, build.trt_lint.EXIT_FINDINGS otherwise."""

from __future__ import annotations

from enginesmith.builder import trt_lint


def add_parser(verbs) -> None:
    p = verbs.add_parser("trt-lint", help="check a graph against what a TensorRT version can parse")
    trt_lint.add_arguments(p)
    p.set_defaults(func=cmd_trt_lint)


def cmd_trt_lint(args) -> int:
    return trt_lint.run(args)
