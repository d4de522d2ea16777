"""Build presets for NVIDIA Jetson: Orin (sm_87) and Thor (sm_110), with the TensorRT each JetPack ships.

A preset is data: the export settings (opset, dtype) the device's TensorRT can parse, the trt-lint
target, and a memory-lean TrtBuildConfig. Jetson GPUs share DRAM with the CPU, so the build and the
runtime compete for the same memory: the presets keep weights out of the plan (STRIP_PLAN +
REFIT_IDENTICAL: the plan holds no weights, they are refit from model.onnx.data when the engine is
loaded, so the weights exist once on disk), cap the builder's workspace, build at optimization
level 2, and use no auxiliary streams. `weight_streaming=True` additionally lets TensorRT keep
weights in host memory and stream them per layer (ICudaEngine.weight_streaming_budget_v2) for
models larger than the memory budget given to the GPU.

Facts (checked 2026-11, see docs/deploy.md for sources):
  Orin  compute capability 8.7; JetPack 6.1/6.2 = L4T r36.4, CUDA 12.6, TensorRT 10.3.
  Thor  compute capability 11.0 (sm_110) with CUDA 13; it was 10.1 (sm_101) under CUDA 12.8/12.9.
        JetPack 7.0/7.1 = L4T r38, CUDA 13.0, TensorRT 10.13.
  TensorRT 11.4.1+ supports JetPack 7.2.2+ on AGX Orin and Thor (11.0-11.3 did not support JetPack).
Neither 10.3 nor 10.13 imports ONNX Attention (10.14), RMSNormalization / RotaryEmbedding /
TensorScatter (10.15): the presets export below opset 23 (Orin: 20, the highest 10.3 documents;
Thor: 22), where attention and norms stay decomposed and TensorRT fuses MatMul-Softmax-MatMul itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from enginesmith.builder import trt_ops
from enginesmith.builder.trt_plan import TrtBuildConfig
from enginesmith.core.errors import UserError


@dataclass(frozen=True)
class JetsonPreset:
    name: str
    device: str
    sm: str                 # compute capability the plan is built for ("8.7")
    cuda_arch: str          # nvcc/CMake name for the plugin library
    jetpack: str
    cuda: str
    tensorrt: str           # the TensorRT version the JetPack ships (trt-lint target)
    opset: int              # export opset that TensorRT parses with fused ops left decomposed
    dtype: str
    build: TrtBuildConfig
    notes: str = ""

    def lint_target(self) -> str:
        return self.tensorrt

    def with_tensorrt(self, version: str) -> "JetsonPreset":
        """The preset for a newer TensorRT on the same device (e.g. 11.4 on JetPack 7.2.2)."""
        v = trt_ops.parse_target(version)
        # Opset 23+ exports fuse RMSNormalization/RotaryEmbedding, imported only from 10.15.
        opset = trt_ops.opset_ceiling(v)[0] if v >= (10, 15) else min(trt_ops.opset_ceiling(v)[0], 22)
        return replace(self, tensorrt=version, opset=opset)


_GiB = 1 << 30

PRESETS: dict[str, JetsonPreset] = {
    "orin": JetsonPreset(
        name="orin", device="Jetson AGX Orin / Orin NX / Orin Nano", sm="8.7", cuda_arch="87",
        jetpack="6.2", cuda="12.6", tensorrt="10.3", opset=20, dtype="fp16",
        build=TrtBuildConfig(max_batch=1, max_input=512, max_positions=2048, opt_batch=1, opt_input=128,
                             opt_positions=512, strip_weights=True, workspace_bytes=1 * _GiB,
                             optimization_level=2, max_aux_streams=0),
        notes="Ampere GPU (no FP8); fp16 or W4A16 (INT4 blocked DQ) weights. Orin Nano shares 8 GB between "
              "CPU and GPU: turn on weight_streaming for models that do not fit beside the KV cache.",
    ),
    "thor": JetsonPreset(
        name="thor", device="Jetson AGX Thor", sm="11.0", cuda_arch="110", jetpack="7.0", cuda="13.0",
        tensorrt="10.13", opset=22, dtype="bf16",
        build=TrtBuildConfig(max_batch=4, max_input=1024, max_positions=8192, opt_batch=1, opt_input=256,
                             opt_positions=1024, strip_weights=True, workspace_bytes=4 * _GiB,
                             optimization_level=2, max_aux_streams=0),
        notes="Blackwell GPU (bf16, FP8, NVFP4 tensor cores), 128 GB shared memory. Under CUDA 12.8/12.9 "
              "toolchains the same chip is sm_101.",
    ),
}


def preset(name: str) -> JetsonPreset:
    key = name.strip().lower().removeprefix("jetson-").removeprefix("jetson")
    if key not in PRESETS:
        raise UserError(f"unknown Jetson preset {name!r}", f"use one of: {', '.join(PRESETS)}")
    return PRESETS[key]


def detect(model_file: Path = Path("/proc/device-tree/model")) -> JetsonPreset | None:
    """The preset for the Jetson this runs on (from the device-tree model string), else None."""
    try:
        model = model_file.read_bytes().decode(errors="replace").strip("\x00 \n").lower()
    except OSError:
        return None
    for name in ("thor", "orin"):
        if re.search(rf"\b{name}\b", model):
            return PRESETS[name]
    return None


def check_device(p: JetsonPreset, sm: str | None) -> None:
    """Refuse to build a preset on a GPU it is not for (a plan runs only on its SM)."""
    valid = {p.sm} | ({"10.1"} if p.name == "thor" else set())  # Thor under CUDA 12.8/12.9
    if sm is None:
        raise UserError(f"the {p.name} preset builds on the Jetson itself and no CUDA GPU is visible",
                        f"run the build on the {p.device}")
    if sm not in valid:
        raise UserError(f"the {p.name} preset is for SM {p.sm}, this GPU is SM {sm}",
                        f"build on the {p.device}, or drop --preset to build for this GPU")
