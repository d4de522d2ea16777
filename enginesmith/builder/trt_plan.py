"""The TensorRT builder: the final ONNX graph -> a serialized plan (+ its plugin libraries).

Written against the TensorRT Python API (10.x; 11.x accepts the same calls) and type-checked with
mypy against its stubs; TensorRT cannot be installed on this project's machines, so none of the
code that touches `tensorrt` has run here (see docs/deploy.md). `tensorrt` and torch are imported
only inside the functions that need them (deferred on purpose: heavy and optional); without
TensorRT, build_plan raises a UserError that says so. runtime/engines/trt_engine.py opens and runs the plan.

Engine directory (next to model.onnx + data, tokenizer/):
    model.plan                 the serialized engine (weights stripped with strip_weights=True)
    plugins/<lib>.so           copies of the plugin libraries the plan was built with
    build.json backend:        {name: "tensorrt", version, plan, sm, device, plugins [{file, sha256}],
                                profiles, flags, weights: "in-plan" | "refit-from-onnx", ...}

Dimension legend: B batch, S new tokens, P cached positions, V vocab, Hkv KV heads, D head dim.
Two optimization profiles: 0 "prefill" (S in 1..max_input) and 1 "decode" (S = 1).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from enginesmith.core import engine_dir, io_names
from enginesmith.core.errors import UserError
from enginesmith.core.tensorrt import Shape, current_sm, ensure_tensorrt, load_plugins, shape_of

if TYPE_CHECKING:
    import tensorrt as trt

PLAN = "model.plan"
PLUGIN_DIR = "plugins"


@dataclass(frozen=True)
class TrtBuildConfig:
    """What a TensorRT build needs beyond the graph; validated once in __post_init__."""

    max_batch: int = 8
    max_input: int = 1024            # most new tokens in one call (prefill chunk)
    max_positions: int = 4096        # KV capacity C: prompt + output
    opt_batch: int = 1
    opt_input: int = 128
    opt_positions: int = 512
    plugin_libraries: tuple[str, ...] = ()
    timing_cache: str | None = None  # read if present, written back after the build
    sparse_weights: bool = False     # BuilderFlag.SPARSE_WEIGHTS (2:4 weights -> sparse tensor cores)
    strip_weights: bool = False      # STRIP_PLAN + REFIT_IDENTICAL: plan without weights, refit from model.onnx.data at load
    weight_streaming: bool = False   # WEIGHT_STREAMING: weights may stay in host memory, streamed per layer
    workspace_bytes: int | None = None
    optimization_level: int = 3      # 0..5; lower builds faster with less memory
    max_aux_streams: int | None = None
    hardware_compatibility: str = "none"  # "none" | "ampere_plus" | "same_compute_capability"

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_input", "max_positions", "opt_batch", "opt_input", "opt_positions"):
            if getattr(self, name) < 1:
                raise UserError(f"invalid {name}={getattr(self, name)}", f"{name} must be >= 1")
        if not (self.opt_batch <= self.max_batch and self.opt_input <= self.max_input
                and self.opt_positions <= self.max_positions and self.max_input <= self.max_positions):
            raise UserError("optimization profile out of order",
                            "need opt_batch <= max_batch, opt_input <= max_input <= max_positions, "
                            "opt_positions <= max_positions")
        if not 0 <= self.optimization_level <= 5:
            raise UserError(f"invalid optimization_level={self.optimization_level}", "use 0..5")
        if self.hardware_compatibility not in ("none", "ampere_plus", "same_compute_capability"):
            raise UserError(f"unknown hardware_compatibility {self.hardware_compatibility!r}",
                            "use none, ampere_plus or same_compute_capability")


@dataclass(frozen=True)
class ProfileShapes:
    """min/opt/max per input for one optimization profile."""

    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)


def profile_shapes(inputs: dict[str, Shape], config: TrtBuildConfig) -> list[ProfileShapes]:
    """Prefill and decode profiles for the dense KV-cache I/O (see export/kv_io.py).

    `inputs` maps each network input to its ONNX shape with -1 for dynamic dims. A past input
    whose sequence dim is fixed (a static-capacity cache) keeps that size in every profile.
    """
    c, b = config, (1, config.opt_batch, config.max_batch)
    profiles = []
    for name, (s_min, s_opt, s_max) in (("prefill", (1, c.opt_input, c.max_input)), ("decode", (1, 1, 1))):
        p_opt = 0 if name == "prefill" else c.opt_positions - 1
        shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
        for tensor, dims in inputs.items():
            if tensor in ("input_ids", "position_ids"):
                shapes[tensor] = ((b[0], s_min), (b[1], s_opt), (b[2], s_max))
            elif tensor == "attention_mask":
                if dims[1] != -1:  # static mask length = capacity
                    shapes[tensor] = ((b[0], dims[1]), (b[1], dims[1]), (b[2], dims[1]))
                else:
                    shapes[tensor] = ((b[0], s_min), (b[1], p_opt + s_opt), (b[2], c.max_positions))
            elif io_names.is_past(tensor):
                heads, seq, dim = dims[1], dims[2], dims[3]
                if seq != -1:
                    shapes[tensor] = tuple((bb, heads, seq, dim) for bb in b)  # type: ignore[assignment]
                else:
                    shapes[tensor] = ((b[0], heads, 0, dim), (b[1], heads, p_opt, dim),
                                      (b[2], heads, c.max_positions - s_min, dim))
            elif -1 not in dims:
                shapes[tensor] = (dims, dims, dims)
            else:
                raise UserError(f"network input {tensor!r} {dims} has dynamic dims enginesmith does not know",
                                "export with `enginesmith build` (export/kv_io.py input names)")
        profiles.append(ProfileShapes(name, shapes))
    return profiles


def _parse_errors(parser: trt.OnnxParser) -> str:
    return "; ".join(str(parser.get_error(i)) for i in range(min(int(parser.num_errors), 5)))


def build_plan(onnx_path: str | Path, out_dir: str | Path, config: TrtBuildConfig) -> dict:
    """Build `out_dir/model.plan` (+ plugins/) from the final graph; return build.json's backend section.

    Peak host memory stays near the size of the weights: the parser reads external data from disk
    itself (nothing is loaded in Python) and the plan is serialized straight to the file.
    """
    ensure_tensorrt()
    import tensorrt as trt

    sm = current_sm()
    if sm is None:
        raise UserError("TensorRT needs a CUDA GPU and none is visible", "run on a machine with an NVIDIA GPU")
    import torch

    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    logger = trt.Logger(trt.Logger.WARNING)
    load_plugins(config.plugin_libraries)
    builder = trt.Builder(logger)
    # Strongly typed: precision comes from the graph. TensorRT 11 ignores the (kept) flag: always typed.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise UserError(f"TensorRT {trt.__version__} could not parse {onnx_path}: {_parse_errors(parser)}",
                        f"run `enginesmith trt-lint {onnx_path} --trt-version {trt.__version__}`")
    inputs = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs[tensor.name] = shape_of(tensor.shape)

    builder_config = builder.create_builder_config()
    builder_config.builder_optimization_level = config.optimization_level
    if config.workspace_bytes:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_bytes)
    if config.max_aux_streams is not None:
        builder_config.max_aux_streams = config.max_aux_streams
    flags = []
    if config.sparse_weights:
        builder_config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
        flags.append("SPARSE_WEIGHTS")
    if config.strip_weights:
        builder_config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        builder_config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
        flags += ["STRIP_PLAN", "REFIT_IDENTICAL"]
    if config.weight_streaming:
        builder_config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
        flags.append("WEIGHT_STREAMING")
    if config.plugin_libraries:  # PagedAttention writes its cache in place (aliased plugin I/O)
        builder_config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if config.hardware_compatibility != "none":
        builder_config.hardware_compatibility_level = getattr(
            trt.HardwareCompatibilityLevel, config.hardware_compatibility.upper())
    profiles = profile_shapes(inputs, config)
    for prof in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.shapes.items():
            profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        builder_config.add_optimization_profile(profile)

    cache_path = Path(config.timing_cache) if config.timing_cache else None
    cache_bytes = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
    timing_cache = builder_config.create_timing_cache(cache_bytes)
    builder_config.set_timing_cache(timing_cache, False)

    serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise UserError(f"TensorRT could not build an engine from {onnx_path} (see the log above)",
                        "check the profile sizes fit GPU memory, or lower max_batch / max_input")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / PLAN, memoryview(serialized))
    if cache_path is not None:
        _write_atomic(cache_path, memoryview(builder_config.get_timing_cache().serialize()))

    plugins = []
    for lib in config.plugin_libraries:
        rel = f"{PLUGIN_DIR}/{Path(lib).name}"
        (out_dir / PLUGIN_DIR).mkdir(exist_ok=True)
        shutil.copy2(lib, out_dir / rel)
        plugins.append({"file": rel, "sha256": engine_dir.sha256(out_dir / rel), "source": str(lib)})
    return {
        "name": "tensorrt", "version": str(trt.__version__), "plan": PLAN, "sm": sm,
        "device": torch.cuda.get_device_name(0), "plugins": plugins,
        "profiles": {p.name: {k: [list(s) for s in v] for k, v in p.shapes.items()} for p in profiles},
        "flags": flags, "weights": "refit-from-onnx" if config.strip_weights else "in-plan",
        "weight_streaming": config.weight_streaming, "hardware_compatibility": config.hardware_compatibility,
        "max_batch": config.max_batch, "max_input": config.max_input, "max_positions": config.max_positions,
    }


def _write_atomic(path: Path, data: memoryview) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
