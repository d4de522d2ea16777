"""CPU: the plugin library compiles for every listed CUDA arch against the shared TensorRT headers,
exports what TensorRT's loadLibrary looks up, and the host-side checks reject bad input.
(TensorRT is not installed anywhere here: the wrappers are compiled, never run.)"""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from plugin_modules import kernels


def _symbols(path, *flags) -> set[str]:
    out = subprocess.run(["nm", "-D", *flags, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def test_trt_plugin_library_builds_and_exports_entry_points(plugin_build):
    lib = plugin_build / "libenginesmith_trt_plugins.so"
    assert lib.exists(), "the TensorRT plugin library was not built"
    defined = _symbols(lib, "--defined-only")
    assert {"getCreators", "setLoggerFinder"} <= defined
    # The only TensorRT symbol it needs from libnvinfer is the registry (static registration).
    undefined = _symbols(lib, "--undefined-only")
    trt_like = {s for s in undefined if "nvinfer" in s.lower() or s.startswith("get") and "Plugin" in s}
    assert trt_like == {"getPluginRegistry"}, trt_like


def test_device_code_covers_every_arch(plugin_build):
    cuobjdump = shutil.which("cuobjdump")
    if cuobjdump is None:
        pytest.skip("cuobjdump is not installed (the build itself used CMAKE_CUDA_ARCHITECTURES=" + kernels.ALL_ARCHS + ")")
    out = subprocess.run([cuobjdump, "--list-elf", str(plugin_build / "libenginesmith_kernels.so")],
                         capture_output=True, text=True, check=True).stdout
    for arch in ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90"):
        assert arch in out, f"no {arch} code in the kernels library"


def test_limits_come_from_the_cpp_layer(kernels_lib):
    limits = kernels_lib.paged_attention_limits()
    assert limits.head_sizes == (64, 128)
    assert limits.block_sizes == (16, 32, 64)
    assert limits.max_query_len == 16


@pytest.mark.parametrize(
    "args, words",
    [
        ((kernels.FLOAT16, 96, 16, 8, 2, 1), ["head size 96", "64, 128"]),
        ((kernels.FLOAT16, 128, 8, 8, 2, 1), ["block size 8", "16, 32, 64"]),
        ((kernels.BFLOAT16, 64, 32, 6, 4, 1), ["num_heads (6)", "num_kv_heads (4)"]),
        ((kernels.FLOAT16, 64, 32, 8, 2, 17), ["query length 17"]),
    ],
)
def test_unsupported_paged_attention_configs_are_rejected(kernels_lib, args, words):
    with pytest.raises(kernels.KernelError) as err:
        kernels_lib.check_paged_attention_config(*args)
    for w in words:
        assert w in str(err.value)


def test_supported_paged_attention_configs_pass(kernels_lib):
    for dtype in (kernels.FLOAT16, kernels.BFLOAT16):
        for d in (64, 128):
            for bs in (16, 32, 64):
                kernels_lib.check_paged_attention_config(dtype, d, bs, 32, 8, 16)


def test_check_24_host_accepts_24_and_names_the_first_bad_group(kernels_lib):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 64)).astype(np.float16)
    groups = w.reshape(32, 16, 4)
    order = np.argsort(np.abs(groups), axis=-1)
    np.put_along_axis(groups, order[..., :2], 0, axis=-1)  # keep the 2 largest of every 4
    w = groups.reshape(32, 64)
    kernels_lib.check_24_host(w)
    w[5, 9] = 1.0
    w[5, 10] = 1.0
    w[5, 11] = 1.0
    w[5, 8] = 1.0
    with pytest.raises(kernels.KernelError, match=r"row 5, columns 8\.\.11"):
        kernels_lib.check_24_host(w)
    w[5, 8:12] = -0.0  # negative zeros count as zeros
    kernels_lib.check_24_host(w)
