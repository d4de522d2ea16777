"""What this machine has to run and compile enginesmith's CUDA libraries: its GPU, nvcc, CMake, Ninja
and the TensorRT headers. Only looks; plugins/compile.py decides what to do with the answers."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


# ----------------------------------------------------------------------------- the GPU

@dataclass(frozen=True)
class Gpu:
    name: str
    arch: str            # "90" for compute capability 9.0
    driver: str | None   # driver version (nvidia-smi)
    source: str          # how it was found: "nvidia-smi" or "torch"


@lru_cache(maxsize=None)
def detect_gpu() -> Gpu | None:
    """The first visible NVIDIA GPU: nvidia-smi, else torch (when it is installed); None without one."""
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30)
            line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and re.fullmatch(r"\d+\.\d+", parts[1]):
                return Gpu(parts[0], parts[1].replace(".", ""), parts[2], "nvidia-smi")
        except (OSError, subprocess.SubprocessError):
            pass
    try:  # deferred on purpose: torch is optional here and slow to import
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability(0)
            return Gpu(torch.cuda.get_device_name(0), f"{major}{minor}", None, "torch")
    except Exception:  # a broken CUDA setup is reported as "no GPU" here; doctor says more
        pass
    return None


# ----------------------------------------------------------------------------- the tools

def _pip_tool(module: str, bin_dir: str, name: str) -> str | None:
    """`name` from the bin dir of the PyPI package `module` (enginesmith[cuda]), else from PATH."""
    try:
        tool = Path(getattr(importlib.import_module(module), bin_dir)) / name  # an optional package
        if tool.is_file():
            return str(tool)
    except (ImportError, AttributeError):
        pass
    return shutil.which(name)


def find_cmake() -> str | None:
    """cmake of the PyPI package `cmake`, else cmake on PATH."""
    return _pip_tool("cmake", "CMAKE_BIN_DIR", "cmake")


def find_ninja() -> str | None:
    """ninja of the PyPI package `ninja`, else ninja on PATH (without it CMake falls back to make)."""
    return _pip_tool("ninja", "BIN_DIR", "ninja")


def find_nvcc() -> str | None:
    """$CUDACXX, nvcc on PATH, $CUDA_HOME/bin/nvcc or /usr/local/cuda/bin/nvcc."""
    env = os.environ.get("CUDACXX")
    if env and Path(env).is_file():
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def find_tensorrt_headers(root: str | None = None) -> Path | None:
    """The folder holding NvInferRuntime.h: `root` or $TENSORRT_ROOT (its include/), else the system's."""
    root = root or os.environ.get("TENSORRT_ROOT")
    places = [Path(root) / "include", Path(root)] if root else [Path("/usr/include/x86_64-linux-gnu"),
                                                                 Path("/usr/include"), Path("/usr/local/include")]
    return next((p for p in places if (p / "NvInferRuntime.h").is_file()), None)


def tool_version(path: str | None, flag: str = "--version") -> str | None:
    """The first version-looking number a tool prints (nvcc: its release), or None."""
    if not path:
        return None
    try:
        out = subprocess.run([path, flag], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", out) or re.search(r"(\d+\.\d+(?:\.\d+)?)", out)
    return m.group(1) if m else None




# ----------------------------------------------------------------------------- archs

def arch_covers(archs, arch: str, ptx: bool = True) -> bool:
    """Whether code compiled for the CMake arch list `archs` ("80-real", "90", "90a", "90-virtual"
    items) runs on sm_<arch>: SASS of the same major and an older or equal minor (sm_80 runs on
    sm_86), or, with `ptx`, PTX of an older arch that the driver compiles at load; "90a" code runs on
    sm_90 only."""
    m = re.fullmatch(r"(\d+)(\d)a?", arch)
    if not m:
        return False
    major, minor = int(m.group(1)), int(m.group(2))
    for item in archs:
        c = re.fullmatch(r"(\d+)(\d)(a?)(-real|-virtual)?", str(item).strip())
        if not c:
            continue
        c_major, c_minor, specific, kind = int(c.group(1)), int(c.group(2)), c.group(3), c.group(4)
        if specific:
            if (c_major, c_minor) == (major, minor):
                return True
            continue
        sass = kind != "-virtual" and c_major == major and c_minor <= minor
        jit = ptx and kind != "-real" and (c_major, c_minor) <= (major, minor)
        if sass or jit:
            return True
    return False
