"""Fixtures for the plugin tests: the plugin modules and one CMake build shared by the session.

The build is made once per machine for one arch (tests/helpers/plugin_build.py; every arch under
ENGINESMITH_TEST_STRICT=1) unless $ENGINESMITH_PLUGINS_BUILD names a directory that already holds it
(on the GPU machine: `enginesmith plugins build`'s cache directory). The kernels need
only nvcc; the TensorRT plugin library also needs the TensorRT headers ($TENSORRT_ROOT, see
tests/helpers/external.py): without them the tests of that library skip, or fail under ENGINESMITH_TEST_STRICT=1.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from helpers.external import TENSORRT, missing
from helpers.plugin_build import compile_targets, tensorrt_root
from plugin_modules import kernels, load


def nvcc_path() -> str | None:
    return shutil.which("nvcc") or (shutil.which("nvcc", path="/usr/local/cuda/bin"))


@pytest.fixture(scope="session")
def kernel_build(request) -> Path:
    """Directory holding libenginesmith_kernels.so; with the TensorRT headers present, the TensorRT
    plugin library and wrapper check too (the ORT ops: ort_ops_lib). Compiled once per machine for one
    arch (tests/helpers/plugin_build.py); under ENGINESMITH_TEST_STRICT=1 (.ci/run) for every arch of
    ALL_ARCHS, the check that each compiles. The kernels need no TensorRT: a GPU machine without its
    headers still runs every kernel test."""
    prebuilt = os.environ.get("ENGINESMITH_PLUGINS_BUILD")
    if prebuilt and (Path(prebuilt) / "libenginesmith_kernels.so").exists():
        return Path(prebuilt)
    if nvcc_path() is None:
        missing("nvcc is not installed: the CUDA plugins cannot be compiled here",
                "install the CUDA toolkit (nvcc on PATH or in /usr/local/cuda/bin)")
    with_trt = tensorrt_root() is not None
    targets = ("enginesmith_kernels",) + (("enginesmith_trt_plugins", "enginesmith_trt_wrapper_check") if with_trt
                                          else ())
    archs = kernels.ALL_ARCHS if os.environ.get("ENGINESMITH_TEST_STRICT") == "1" else None
    what = "the kernels" + (" and TensorRT plugin libraries" if with_trt else " library")
    return compile_targets(request.config, targets, archs=archs, what=what)


@pytest.fixture(scope="session")
def plugin_build(kernel_build) -> Path:
    """kernel_build, required to hold the TensorRT plugin library (its headers: $TENSORRT_ROOT)."""
    TENSORRT.require()
    if not (kernel_build / "libenginesmith_trt_plugins.so").exists():
        missing(f"{kernel_build} was built without the TensorRT plugins", "unset ENGINESMITH_PLUGINS_BUILD "
                "or point it at a build made with TENSORRT_ROOT set")
    return kernel_build


@pytest.fixture(scope="session")
def kernels_lib(kernel_build):
    """The ctypes binding, pointed at the session's build."""
    os.environ["ENGINESMITH_KERNELS_LIB"] = str(kernel_build / "libenginesmith_kernels.so")
    kernels.lib.cache_clear()
    kernels.lib()
    return kernels


@pytest.fixture(scope="session")
def reference():
    return load("reference")


@pytest.fixture(scope="module")
def ops_lib(request):
    """The library: $ENGINESMITH_ORT_OPS_LIB if it names a built one (the GPU machine), else the
    session's sm_90 build of the ops (ort_ops_lib; named in the environment for this module only:
    an ort-cuda build's default would otherwise pick the ops up in later tests)."""
    env = os.environ.get("ENGINESMITH_ORT_OPS_LIB")
    if env and Path(env).is_file():
        yield Path(env)
        return
    path = request.getfixturevalue("ort_ops_lib")
    os.environ["ENGINESMITH_ORT_OPS_LIB"] = str(path)
    yield path
    if env is None:
        os.environ.pop("ENGINESMITH_ORT_OPS_LIB", None)
    else:
        os.environ["ENGINESMITH_ORT_OPS_LIB"] = env
