"""The CUDA libraries the tests compile, once per machine: one CMake build folder per arch and source
tree under the temp dir (never the user's cache), shared by pytest-xdist workers and later sessions (ninja rebuilds
what changed), built target by target as tests ask for them, under a lock.

One arch only: the GPU's, or sm_90 on a machine without one (the CPU tests run the ops' CPU kernels
and check that the CUDA code compiles; PTX alone unless strict, see target_arch). The every-arch build runs under ENGINESMITH_TEST_STRICT=1
(.ci/run), where `kernel_build` compiles the kernels and TensorRT plugins for all of ALL_ARCHS.
While compiling, the tests say so on the terminal (what, for which arch, and the seconds it took).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from enginesmith.plugins import compile as plugin_compile
from helpers.external import TENSORRT


def target_arch() -> str:
    """The arch the tests compile for: this machine's GPU; else sm_90 (H100/H200) as PTX alone
    ("90-virtual": the device code goes through the compiler's front end and NVVM, not ptxas, about a
    third less compile time; nothing runs it here), or as SASS under ENGINESMITH_TEST_STRICT=1."""
    gpu = plugin_compile.detect_gpu()
    if gpu:
        return gpu.arch
    return "90" if os.environ.get("ENGINESMITH_TEST_STRICT") == "1" else "90-virtual"


def configure_flags(archs: str) -> list[str]:
    """Without a GPU and outside strict mode (a PTX-only build, nothing runs the kernels) the attention
    kernels' plain variants are left out (ENGINESMITH_PLAIN_VARIANTS=none: fewer kernels; every
    variant that serves calls with options is still compiled); else the build users get."""
    return ["-DENGINESMITH_PLAIN_VARIANTS=none"] if archs.endswith("-virtual") else []


def shared_root() -> Path:
    return Path(tempfile.gettempdir()) / f"enginesmith-tests-{os.getuid()}"


def announce(config: pytest.Config, line: str) -> None:
    """`line` on the terminal now, through pytest's capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    reporter = config.pluginmanager.getplugin("terminalreporter")
    guard = capture.global_and_fixture_disabled() if capture else contextlib.nullcontext()
    with guard:
        if reporter is not None:
            reporter.write_line(line)


def tensorrt_root() -> str | None:
    """The TensorRT headers' root when present (tests/helpers/external.py): the build then has the plugin targets."""
    root = TENSORRT.path()
    return str(root) if (root / TENSORRT.marker).exists() else None


def compile_targets(config: pytest.Config, targets: tuple[str, ...], archs: str | None = None,
                    what: str = "the CUDA libraries") -> Path:
    """Build `targets` for `archs` (default: target_arch()) in the shared folder and return it; the
    folder is configured with the TensorRT targets whenever the headers are present, so the ops and
    the kernels share one build of the paged kernels."""
    archs = archs or target_arch()
    trt_root = tensorrt_root()
    trt = trt_root is not None
    tag = archs.replace(";", "_").replace("-real", "").replace("-virtual", "ptx")
    # one folder per source tree too: CMake refuses a folder configured from another checkout (and
    # another checkout's folder must never stand in for this one's sources)
    source = hashlib.sha256(str(plugin_compile.PLUGINS_DIR).encode()).hexdigest()[:8]
    out = shared_root() / f"plugins-sm{tag}{'-trt' if trt else ''}-{source}"
    out.mkdir(parents=True, exist_ok=True)
    configure, build = plugin_compile.cmake_commands(out, archs, trt, trt_root, jobs=os.cpu_count() or 2,
                                                     targets=targets)
    configure += configure_flags(archs)
    with open(out / ".lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        started = time.monotonic()
        announce(config, f"\nenginesmith tests: compiling {what} for sm {archs} in {out} (once; ninja reuses it) ...")
        for cmd in ([configure] if not (out / "build.ninja").is_file() and not (out / "Makefile").is_file() else []) + \
                [build]:
            proc = subprocess.run(cmd, capture_output=True, text=True)
            assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
        announce(config, f"enginesmith tests: {what} ready in {time.monotonic() - started:.0f} s")
    return out
