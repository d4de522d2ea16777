"""`enginesmith build --backend trt`: the TensorRT part of a build, for enginesmith/builder/engine.py to call.

    args/preset -> TrtBuildConfig        trt_config(...)            (validated before any export)
    fail fast                            check_ready(preset)        (TensorRT + GPU + right Jetson)
    export as usual (preset opset/dtype) ... engine.py ...
    model.onnx -> trt-lint -> plan       build_tensorrt(tmp_dir, config, target)  -> build.json "backend"

The builder itself (TrtBuildConfig, profiles, build_plan) is trt_plan.py: jetson.py's presets hold a
TrtBuildConfig and this module reads the presets, so the config cannot live here without a cycle.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from enginesmith.builder import jetson, trt_lint
from enginesmith.builder.trt_plan import TrtBuildConfig, build_plan
from enginesmith.core.errors import UserError
from enginesmith.core.tensorrt import current_sm, require_tensorrt


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --trt-* flags of `build` (used only with --backend trt)."""
    g = parser.add_argument_group("TensorRT (--backend trt)")
    g.add_argument("--preset", choices=sorted(jetson.PRESETS), default=None,
                   help="Jetson preset: export opset/dtype and a memory-lean build for that device")
    g.add_argument("--trt-max-batch", type=int, default=None, help="largest batch of the profiles (default 8)")
    g.add_argument("--trt-max-input", type=int, default=None, help="most new tokens in one call (default 1024)")
    g.add_argument("--trt-max-positions", type=int, default=None, help="KV capacity: prompt + output (default 4096)")
    g.add_argument("--plugins", action="append", default=[], metavar="LIB.so", help="plugin library (repeatable)")
    g.add_argument("--timing-cache", metavar="FILE", default=None, help="TensorRT timing cache to read and update")
    g.add_argument("--sparse-weights", action="store_true", help="let TensorRT use 2:4 sparse weights")
    g.add_argument("--strip-weights", action="store_true",
                   help="plan without weights; refit from model.onnx.data at load (weights once on disk)")
    g.add_argument("--weight-streaming", action="store_true", help="allow streaming weights from host memory")
    g.add_argument("--trt-version", default=None, help="lint against this TensorRT (default: the installed one)")


def trt_config(preset: str | None = None, max_batch: int | None = None, max_input: int | None = None,
               max_positions: int | None = None, plugins: list[str] | tuple[str, ...] = (),
               timing_cache: str | None = None, sparse_weights: bool = False, strip_weights: bool = False,
               weight_streaming: bool = False) -> TrtBuildConfig:
    """The build config: the preset's (or the defaults), then the explicit values over it."""
    base = jetson.preset(preset).build if preset else TrtBuildConfig()
    batch = max_batch if max_batch is not None else base.max_batch
    tokens = max_input if max_input is not None else base.max_input
    positions = max_positions if max_positions is not None else base.max_positions
    for lib in plugins:
        if not Path(lib).is_file():
            raise UserError(f"plugin library {lib} does not exist", "build it: cmake -S plugins -B plugins/build")
    return replace(base, max_batch=batch, max_input=tokens, max_positions=positions,
                   opt_batch=min(base.opt_batch, batch), opt_input=min(base.opt_input, tokens),
                   opt_positions=min(base.opt_positions, positions),
                   plugin_libraries=tuple(str(Path(p).resolve()) for p in plugins),
                   timing_cache=timing_cache or base.timing_cache,
                   sparse_weights=sparse_weights or base.sparse_weights,
                   strip_weights=strip_weights or base.strip_weights,
                   weight_streaming=weight_streaming or base.weight_streaming)


def config_from_args(args: argparse.Namespace) -> TrtBuildConfig:
    return trt_config(args.preset, args.trt_max_batch, args.trt_max_input, args.trt_max_positions, args.plugins,
                      args.timing_cache, args.sparse_weights, args.strip_weights, args.weight_streaming)


def check_ready(preset: str | None = None) -> str:
    """Before exporting: TensorRT importable, a GPU visible, and the preset's device. Returns the TRT version."""
    version = require_tensorrt()
    if preset:
        jetson.check_device(jetson.preset(preset), current_sm())
    return version


def build_tensorrt(engine_tmp: Path, config: TrtBuildConfig, lint_target: str | None = None) -> dict:
    """Lint engine_tmp/model.onnx for the target TensorRT, then build the plan there; return build.json's backend."""
    version = require_tensorrt()
    graph = Path(engine_tmp) / "model.onnx"
    findings = trt_lint.lint(graph, lint_target or version)
    if findings:
        shown = "; ".join(str(f) for f in findings[:3])
        raise UserError(f"the graph has {len(findings)} TensorRT problem(s): {shown}",
                        "export it (`enginesmith export --out m.onnx`) and see all with `enginesmith trt-lint "
                        f"m.onnx --trt-version {lint_target or version}`; on Jetson use --preset")
    return build_plan(graph, engine_tmp, config)
