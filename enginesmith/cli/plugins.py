"""`enginesmith plugins build`: compile the CUDA libraries (ONNX Runtime ops, kernels, TensorRT
plugins) now rather than on first use, and print their paths. (First use compiles only the library it
needs; this verb compiles them all. A binary wheel ships them compiled: plugins/prebuilt.py.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from enginesmith.core.errors import UserError
from enginesmith.plugins import compile as plugin_compile


def add_parser(verbs) -> None:
    p = verbs.add_parser("plugins", help="the CUDA libraries (ONNX Runtime ops, kernels, TensorRT plugins)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    q = actions.add_parser("build", help="compile them now (else the ops compile on first use) and print their paths")
    q.add_argument("--arch", default=None, metavar="SM",
                   help="CUDA compute capability without the dot, e.g. 90 (H100/H200) or 80,90 "
                        "(default: this machine's GPU)")
    q.add_argument("--trt", action="store_true", help="also the TensorRT plugin library (needs TENSORRT_ROOT)")
    q.add_argument("--tensorrt-root", default=None, metavar="DIR", help="TensorRT install (default: $TENSORRT_ROOT)")
    q.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: all cores)")
    q.add_argument("--force", action="store_true", help="compile again even if the cache holds them")
    q.set_defaults(func=cmd_plugins_build)


def cmd_plugins_build(args) -> int:
    """plugins build: compile the libraries into the cache ($ENGINESMITH_PLUGINS_BUILD: in place) and
    print their paths, one a line."""
    if args.jobs is not None and args.jobs < 1:
        raise UserError(f"--jobs {args.jobs} must be at least 1", "leave it out to use all cores")
    if args.arch is not None:
        archs = plugin_compile.parse_archs(args.arch)
    else:
        gpu = plugin_compile.detect_gpu()
        if gpu is None:
            raise UserError("no NVIDIA GPU found to compile for",
                            "pass --arch, e.g. --arch 90 (H100/H200) or 80 (A100)")
        archs = (gpu.arch,)
    root = args.tensorrt_root or os.environ.get("TENSORRT_ROOT")
    build_env = os.environ.get(plugin_compile.BUILD_ENV)
    if build_env:
        out = plugin_compile.build_into(Path(build_env), archs, args.trt, root, args.jobs)
    else:
        out = plugin_compile.build_cached(archs, args.trt, root, args.jobs, force=args.force)
    for name in plugin_compile.library_names(args.trt):
        lib = plugin_compile.LIBRARIES[name]
        if not (out / lib).is_file():
            continue
        print(out / lib)
        where = plugin_compile.locate(name, any_arch=True)
        if where is not None and where.built and where.path != out / lib:
            print(f"note: {where.path} ({where.origin}) is found before this {lib} and is used instead "
                  "(plugins/compile.py's order)", file=sys.stderr)
    return 0
