"""CPU: the plugin library compiles for every listed CUDA arch against the shared TensorRT headers,
exports what TensorRT's loadLibrary looks up, and the host-side checks reject bad input.
(TensorRT is not installed anywhere here: the wrappers are compiled, never run.)"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from helpers.external import missing
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


def _cuobjdump() -> str | None:
    """cuobjdump on PATH, else the one the nvidia-cuda-cuobjdump wheel (a test extra) puts under nvidia/cu13/bin."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia
    except ImportError:
        return None
    candidates = [Path(base) / "cu13" / "bin" / "cuobjdump" for base in nvidia.__path__]
    return next((str(c) for c in candidates if c.is_file()), None)


def test_device_code_covers_every_arch(plugin_build):
    if os.environ.get("ENGINESMITH_TEST_STRICT") != "1":
        pytest.skip("the every-arch build runs under ENGINESMITH_TEST_STRICT=1 (.ci/run); the tests compiled one arch "
                    "(tests/helpers/plugin_build.py)")
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        missing("cuobjdump is not installed (the build itself used CMAKE_CUDA_ARCHITECTURES=" + kernels.ALL_ARCHS + ")",
                "pip install nvidia-cuda-cuobjdump, or put the CUDA toolkit's cuobjdump on PATH")
    out = subprocess.run([cuobjdump, "--list-elf", str(plugin_build / "libenginesmith_kernels.so")],
                         capture_output=True, text=True, check=True).stdout
    for arch in ("sm_80", "sm_86", "sm_87", "sm_89", "sm_90"):
        assert arch in out, f"no {arch} code in the kernels library"


def test_limits_come_from_the_cpp_layer(kernels_lib):
    """The C API reports what the build compiled in from plugins/limits.json (their one definition)."""
    from plugin_modules import load

    limits = kernels_lib.paged_attention_limits()
    expected = load("limits").limits()["paged_attention"]
    assert limits.head_sizes == expected["head_sizes"]
    assert limits.block_sizes == expected["block_sizes"]
    assert limits.max_query_len == expected["max_query_len"]


def test_split_counters_for_the_single_kernel_merge(kernels_lib):
    """One persistent int32 counter per (sequence, KV head, row block: 16 rows, or 64 when G x Sq > 16),
    whatever the split count."""
    L = kernels_lib.lib()
    assert L.es_abi_version() == kernels_lib.ABI_VERSION
    assert L.es_paged_attention_counters(2, 1, 32, 8) == 16   # G 4 x Sq 1: one row block per KV head
    assert L.es_paged_attention_counters(2, 16, 16, 4) == 8   # G 4 x Sq 16 = 64 rows: one 64-row block
    assert L.es_paged_attention_counters(1, 16, 16, 2) == 4   # G 8 x Sq 16 = 128 rows: 2 row blocks
    assert L.es_paged_attention_counters(1, 9, 4, 2) == 2     # G 2 x Sq 9 = 18 rows: one 64-row block
    assert L.es_paged_attention_counters(3, 5, 9, 3) == 9     # G 3 x Sq 5 = 15 rows: 1 row block


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
        for d in (64, 128, 256):
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


# ---- The wrappers' own input validation, called as TensorRT would call it (createPlugin,
# configurePlugin) from a host harness; no TensorRT library is loaded (it links with --no-undefined).

class _Wrappers:
    def __init__(self, path):
        import ctypes

        self.lib = ctypes.CDLL(str(path))
        self.ctypes = ctypes
        I, P, I64 = ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
        self.lib.es_trt_paged_attention_create.argtypes = [I, I, I, I, I, P, I]
        self.lib.es_trt_paged_attention_configure.argtypes = [I, I, I, I, P, P, I64, I64, I, P, I]
        self.lib.es_trt_sparse_gemm_create.argtypes = [P, I, I, I, P, I]
        self.lib.es_trt_field_names.argtypes = [P, I]

    def call(self, name, *args):
        buf = self.ctypes.create_string_buffer(4096)
        rc = getattr(self.lib, name)(*args, buf, 4096)
        return rc, buf.value.decode()

    def dims(self, *d):
        return (self.ctypes.c_int64 * len(d))(*d)


@pytest.fixture(scope="module")
def wrappers(plugin_build):
    path = plugin_build / "libenginesmith_trt_wrapper_check.so"
    assert path.exists(), "the wrapper check harness was not built"
    return _Wrappers(path)


def test_creators_advertise_their_fields(wrappers):
    buf = wrappers.ctypes.create_string_buffer(1024)
    wrappers.lib.es_trt_field_names(buf, 1024)
    fields = dict(part.split(":") for part in buf.value.decode().split(";"))
    assert set(fields) == {"PagedAttention", "SparseGemm24"}
    assert fields["PagedAttention"].split(",")[:4] == ["num_heads", "num_kv_heads", "head_size", "block_size"]
    assert fields["SparseGemm24"] == "weight,out_features,in_features"


@pytest.mark.parametrize(
    "args, ok, words",
    [
        ((32, 8, 128, 16, 1), True, []),
        ((9, 3, 64, 64, 0), True, []),
        ((32, 8, 96, 16, 1), False, ["head size 96", "64, 128"]),
        ((32, 8, 128, 8, 1), False, ["block size 8"]),
        ((30, 8, 128, 16, 1), False, ["num_heads (30)"]),
        ((32, 8, 128, 16, 2), False, ["write_kv"]),
    ],
)
def test_paged_attention_creator_validates(wrappers, args, ok, words):
    rc, msg = wrappers.call("es_trt_paged_attention_create", *args)
    assert (rc == 0) == ok, msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize(
    "query, cache, dtype, ok, words",
    [
        ((2, 1, 32, 128), (100, 16, 8, 128), 0, True, []),
        ((2, 4, 32, 128), (100, 16, 8, 128), 1, True, []),
        ((2, 1, 32, 128), (100, 16, 8, 128), 2, False, ["float16 or bfloat16"]),
        ((2, 17, 32, 128), (100, 16, 8, 128), 0, False, ["query length 17"]),
        ((2, 1, 32, 64), (100, 16, 8, 128), 0, False, ["query must be"]),
        ((2, 1, 32, 128), (100, 32, 8, 128), 0, False, ["caches must be [NB, 16, 8, 128]"]),
        ((2, 1, 32, 128), (100, 16, 4, 128), 0, False, ["caches must be"]),
    ],
)
def test_paged_attention_configure_validates(wrappers, query, cache, dtype, ok, words):
    rc, msg = wrappers.call("es_trt_paged_attention_configure", 32, 8, 128, 16, wrappers.dims(*query),
                            wrappers.dims(*cache), query[0], 8, dtype)
    assert (rc == 0) == ok, msg
    for w in words:
        assert w in msg


def _weight_24(n, k):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((n, k)).astype(np.float16)
    w.reshape(n, k // 4, 4)[..., :2] = 0
    return w


def test_sparse_gemm_creator_accepts_24_and_rejects_dense(wrappers, kernels_lib):
    w = _weight_24(32, 64)
    rc, msg = wrappers.call("es_trt_sparse_gemm_create", w.ctypes.data, 32, 64, 0)
    if not kernels_lib.sparse_available():
        assert rc != 0 and "without cuSPARSELt" in msg
        missing("the kernels library was built without cuSPARSELt: the 2:4 check ran, the accepting path cannot",
                "pip install nvidia-cusparselt-cu13 (a test extra) and rebuild")
    assert rc == 0, msg
    w[7, 12:16] = 1.0
    rc, msg = wrappers.call("es_trt_sparse_gemm_create", w.ctypes.data, 32, 64, 0)
    assert rc != 0 and "row 7, columns 12..15" in msg and "not 2:4" in msg


def test_sparse_gemm_creator_rejects_bad_shapes(wrappers):
    w = _weight_24(24, 64)
    rc, msg = wrappers.call("es_trt_sparse_gemm_create", w.ctypes.data, 24, 64, 0)
    assert rc != 0 and "multiples of 16" in msg
    rc, msg = wrappers.call("es_trt_sparse_gemm_create", w.ctypes.data, 32, 64, 0)  # 24*64 values given
    assert rc != 0


def test_profitability_rule_reads_the_measured_table():
    from plugin_modules import load

    prof = load("profitability")
    table = prof.load_table()
    assert table["device"]
    # Decode-sized M never pays on the measured GPU; the rule answers for unmeasured shapes too.
    assert not prof.sparse_is_profitable(4096, 4096, 1, table)
    for key, entry in table["shapes"].items():
        k, n = (int(v) for v in key.split("x"))
        if entry["min_m"] is not None:
            assert prof.sparse_is_profitable(k, n, entry["min_m"], table)
            assert not prof.sparse_is_profitable(k, n, 1, table)


def test_profitability_rule_does_not_extrapolate_to_much_smaller_products():
    from plugin_modules import load

    prof = load("profitability")
    table = {"device": "t", "threshold": 1.05, "shapes": {"2048x2048": {"speedup_by_m": {"256": 1.5}, "min_m": 256}}}
    assert prof.sparse_is_profitable(2048, 2048, 256, table)
    assert prof.sparse_is_profitable(1024, 2048, 256, table)      # half the product: nearest shape decides
    assert not prof.sparse_is_profitable(576, 1536, 4096, table)  # SmolLM2's MLP: far below what was measured
