"""ctypes binding over libenginesmith_kernels.so: runs the plugin kernels on torch CUDA tensors
without TensorRT. Used by tests and benchmarks; the engine itself reaches the kernels through the
TensorRT plugin library.

Dimension legend: B sequences, Sq query tokens, H query heads, Hkv KV heads, D head size,
BS page size, NB pages in the pool, MB pages per sequence, T new tokens.

The library is found as plugins/compile.py says ($ENGINESMITH_KERNELS_LIB, $ENGINESMITH_PLUGINS_BUILD,
plugins/build of a checkout, else the cache entry for this machine's GPU, compiled on first use).
"""

from __future__ import annotations

import ctypes
import importlib.util
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from enginesmith.plugins import compile as plugin_compile

ALL_ARCHS = "80-real;86-real;87-real;89-real;90"

FLOAT16, BFLOAT16 = 0, 1  # enginesmith::DType
ABI_VERSION = 5  # es_abi_version() of the library this binding matches (capi/enginesmith_kernels_capi.cpp)


class KernelError(RuntimeError):
    """A kernel-layer call failed; the message is the C++ layer's (it names the input at fault)."""


def library_path() -> Path | None:
    """Where the library is, or would be compiled to on this machine (None: no GPU, nothing built)."""
    where = plugin_compile.locate("kernels", any_arch=True)
    return where.path if where else None


def cusparselt_library() -> Path | None:
    """libcusparseLt.so.0 of the pip package nvidia-cusparselt-cu13 (nvidia/cusparselt/ up to 0.9,
    nvidia/cu13/ from 0.10), or None."""
    for name in ("nvidia.cusparselt", "nvidia.cu13"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for base in (spec.submodule_search_locations or []) if spec else []:
            so = Path(base) / "lib" / "libcusparseLt.so.0"
            if so.exists():
                return so
    return None


@lru_cache(maxsize=None)
def lib() -> ctypes.CDLL:
    """The library, loaded once; compiled into the cache first if it is not built (plugins/compile.py)."""
    path = plugin_compile.ensure("kernels")
    try:  # torch loads the CUDA runtime its wheels ship (libcudart.so.13) with RTLD_GLOBAL
        import torch  # noqa: F401
    except ImportError:
        pass
    so = cusparselt_library()  # load it first so the library's NEEDED entry resolves to this copy
    if so is not None:
        ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    L = ctypes.CDLL(str(path))
    P, I, I64, SZ, F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_size_t, ctypes.c_float
    sig = {
        "es_last_error": (ctypes.c_char_p, []),
        "es_abi_version": (I, []),
        "es_paged_attention_limits": (I, [P, P, P, P, P, P]),
        "es_paged_attention_check": (I, [I, I, I, I, I, I]),
        "es_paged_attention_plan": (I, [I] * 9 + [P, P]),
        "es_paged_attention_counters": (I, [I, I, I, I]),
        "es_paged_attention": (I, [P] * 7 + [SZ, P] + [I] * 9 + [F, I, P, I, I, I, I, P, P, P, P]),
        "es_write_kv": (I, [P] * 6 + [I] * 6 + [P]),
        "es_sparse_available": (I, []),
        "es_check_24_host": (I, [P, I64, I64]),
        "es_check_24_device": (I, [P, I64, I64, P, P, P]),
        "es_sparse_gemm_create": (P, [I, I64, I64, P, P]),
        "es_sparse_gemm_create_from_blob": (P, [P, SZ, P]),
        "es_sparse_gemm_export": (I, [P, P, P, P]),
        "es_sparse_gemm_workspace_size": (I, [P, I64, I, P]),
        "es_sparse_gemm_run": (I, [P, P, P, I64, P, SZ, I, P]),
        "es_sparse_gemm_algorithm_count": (I, [P, I64, P]),
        "es_sparse_gemm_destroy": (None, [P]),
    }
    if L.es_abi_version() != ABI_VERSION:
        raise KernelError(f"{path} has C API version {L.es_abi_version()}, this binding needs {ABI_VERSION}: "
                          "rebuild plugins/ (plugins/README.md)")
    for name, (res, argtypes) in sig.items():
        fn = getattr(L, name)
        fn.restype = res
        fn.argtypes = argtypes
    return L


def _check(rc: int) -> None:
    if rc != 0:
        raise KernelError(lib().es_last_error().decode())


@dataclass(frozen=True)
class PagedAttentionLimits:
    head_sizes: tuple[int, ...]
    block_sizes: tuple[int, ...]
    max_query_len: int
    max_splits: int


def paged_attention_limits() -> PagedAttentionLimits:
    """The supported head sizes, block sizes and limits, as the C++ layer defines them."""
    hs, bs = (ctypes.c_int * 8)(), (ctypes.c_int * 8)()
    nh, nb, mq, ms = ctypes.c_int(), ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    _check(lib().es_paged_attention_limits(hs, ctypes.byref(nh), bs, ctypes.byref(nb), ctypes.byref(mq), ctypes.byref(ms)))
    return PagedAttentionLimits(tuple(hs[: nh.value]), tuple(bs[: nb.value]), mq.value, ms.value)


def check_paged_attention_config(dtype: int, head_size: int, block_size: int, num_heads: int, num_kv_heads: int, query_len: int) -> None:
    """Raise KernelError with the C++ layer's reason if the configuration is unsupported."""
    _check(lib().es_paged_attention_check(dtype, head_size, block_size, num_heads, num_kv_heads, query_len))


def _torch_dtype_code(t) -> int:
    import torch

    if t.dtype == torch.float16:
        return FLOAT16
    if t.dtype == torch.bfloat16:
        return BFLOAT16
    raise KernelError(f"dtype {t.dtype} is not supported (float16, bfloat16)")


def _stream():
    import torch

    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def paged_attention_plan(batch, query_len, num_heads, num_kv_heads, head_size, block_size, max_blocks, num_splits=0,
                         dtype=FLOAT16):
    """(splits, workspace bytes) the launcher uses for these shapes (num_splits=0: its own choice)."""
    splits, ws = ctypes.c_int(), ctypes.c_size_t()
    _check(lib().es_paged_attention_plan(batch, query_len, num_heads, num_kv_heads, head_size, block_size,
                                         max_blocks, num_splits, dtype, ctypes.byref(splits), ctypes.byref(ws)))
    return splits.value, ws.value


# How split-K partials are merged (pa::ReduceMode): "auto" ($ES_PAGED_ATTENTION_REDUCE, default
# two), "single" (the last block of each (sequence, KV head) merges: one kernel; ~1 us slower at
# batch 1 on an H100), "two" (a separate reduce kernel).
REDUCE_MODES = {"auto": 0, "single": 1, "two": 2}


class PagedAttention:
    """Preallocates the workspace, the split counters (zeroed once here; every call leaves them zero)
    and the error flag once; call like a function (benchmarks reuse it, also inside CUDA graphs).

    dependent_launch: None = the launcher's choice (on on sm_90), or a
    bool: launch the attention kernel as a programmatic dependent of the previous kernel.
    prefetch_past: request the past K/V (positions < context - Sq) before waiting for that kernel;
    only when no kernel still running writes them, the tables or the lengths (pa::Params).
    A call given new_key / new_value [B, Sq, Hkv, D] and slot_mapping [B, Sq] int32 does the fused KV
    write: what write_kv followed by attention gives, in one kernel, when every slot is its token's
    slot in the block table (anything else is flagged, not written; pa::Params)."""

    def __init__(self, query, k_cache, v_cache, block_tables, num_splits: int = 0, scale: float = 0.0,
                 reduce: str = "auto", dependent_launch: bool | None = None, prefetch_past: bool = False):
        import torch

        B, Sq, H, D = query.shape
        NB, BS, Hkv, D2 = k_cache.shape
        assert D2 == D and v_cache.shape == k_cache.shape, "k_cache/v_cache must be [NB, BS, Hkv, D]"
        if reduce not in REDUCE_MODES:
            raise KernelError(f"reduce must be one of {sorted(REDUCE_MODES)}, got {reduce!r}")
        self.shape = (B, Sq, H, Hkv, D, BS, NB, block_tables.shape[1])
        self.dtype = _torch_dtype_code(query)
        self.splits, ws = paged_attention_plan(B, Sq, H, Hkv, D, BS, block_tables.shape[1], num_splits, self.dtype)
        self.workspace = torch.empty(max(ws, 16), dtype=torch.uint8, device=query.device)
        self.ws_bytes = ws
        self.num_counters = lib().es_paged_attention_counters(B, Sq, H, Hkv)
        self.counters = torch.zeros(max(self.num_counters, 1), dtype=torch.int32, device=query.device)
        self.reduce = REDUCE_MODES[reduce]
        self.dependent_launch = -1 if dependent_launch is None else int(bool(dependent_launch))
        self.prefetch_past = int(bool(prefetch_past))
        self.error_flag = torch.zeros(1, dtype=torch.int32, device=query.device)
        self.scale = scale

    def __call__(self, query, k_cache, v_cache, block_tables, context_lens, out=None, new_key=None, new_value=None,
                 slot_mapping=None):
        import torch

        B, Sq, H, Hkv, D, BS, NB, MB = self.shape
        for name, t, dt in (("block_tables", block_tables, torch.int32), ("context_lens", context_lens, torch.int32)):
            if t.dtype != dt or not t.is_contiguous():
                raise KernelError(f"{name} must be a contiguous int32 tensor")
        fused = [t is not None for t in (new_key, new_value, slot_mapping)]
        if any(fused):
            if not all(fused):
                raise KernelError("the fused KV write needs new_key, new_value and slot_mapping together")
            for name, t in (("new_key", new_key), ("new_value", new_value)):
                if tuple(t.shape) != (B, Sq, Hkv, D) or t.dtype != query.dtype or not t.is_contiguous():
                    raise KernelError(f"{name} must be a contiguous {query.dtype} tensor [{B}, {Sq}, {Hkv}, {D}]")
            if tuple(slot_mapping.shape) != (B, Sq) or slot_mapping.dtype != torch.int32 or not slot_mapping.is_contiguous():
                raise KernelError(f"slot_mapping must be a contiguous int32 tensor [{B}, {Sq}]")
        if out is None:
            out = torch.empty_like(query)
        _check(lib().es_paged_attention(
            query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), self.workspace.data_ptr(), self.ws_bytes,
            self.error_flag.data_ptr(), B, Sq, H, Hkv, D, BS, NB, MB, self.splits, self.scale, self.dtype,
            self.counters.data_ptr(), self.num_counters, self.reduce, self.dependent_launch,
            self.prefetch_past, _ptr(new_key), _ptr(new_value), _ptr(slot_mapping), _stream()))
        return out


def paged_attention(query, k_cache, v_cache, block_tables, context_lens, num_splits: int = 0, scale: float = 0.0,
                    reduce: str = "auto", dependent_launch: bool | None = None, prefetch_past: bool = False):
    """out [B, Sq, H, D] (see paged_attention.h). Returns (out, error_flag int)."""
    op = PagedAttention(query, k_cache, v_cache, block_tables, num_splits, scale, reduce, dependent_launch,
                        prefetch_past)
    out = op(query, k_cache, v_cache, block_tables, context_lens)
    return out, int(op.error_flag.item())


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


def write_kv(key, value, slot_mapping, k_cache, v_cache, error_flag=None) -> int | None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T] (int32, -1 skips). Returns the
    error flag; given `error_flag` (int32 [1] on the device) it ORs the bits in there instead and
    returns None without synchronizing (usable inside a CUDA graph capture)."""
    import torch

    T, Hkv, D = key.shape
    NB, BS = k_cache.shape[:2]
    flag = torch.zeros(1, dtype=torch.int32, device=key.device) if error_flag is None else error_flag
    _check(lib().es_write_kv(key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(), k_cache.data_ptr(),
                             v_cache.data_ptr(), flag.data_ptr(), T, Hkv, D, BS, NB, _torch_dtype_code(key), _stream()))
    return int(flag.item()) if error_flag is None else None


def sparse_available() -> bool:
    return bool(lib().es_sparse_available())


def check_24_host(weight_u16) -> None:
    """Validate a 2:4 pattern on the host: weight is a numpy uint16/float16 array [N, K]."""
    import numpy as np

    w = np.ascontiguousarray(weight_u16).view(np.uint16)
    _check(lib().es_check_24_host(w.ctypes.data, w.shape[0], w.shape[1]))


def check_24_device(weight) -> tuple[int, int]:
    """(bad groups, first bad group index or -1) for a CUDA fp16/bf16 weight [N, K]; raises if bad."""
    bad, first = ctypes.c_int64(), ctypes.c_int64()
    rc = lib().es_check_24_device(weight.data_ptr(), weight.shape[0], weight.shape[1], ctypes.byref(bad),
                                  ctypes.byref(first), _stream())
    _check(rc)
    return bad.value, first.value


class SparseGemm24:
    """Y[M, N] = X[M, K] · Wᵀ with W [N, K] 2:4 sparse, compressed once at construction.

    `config`: cuSPARSELt's kernel configuration the calls use (-1, the default: its own selection;
    else an id below algorithm_count(M)). Time the choices before keeping one (the TensorRT plugin
    offers them as tactics; benchmarks/plugins/bench_plugins.py --tune tries each in a child process)."""

    def __init__(self, weight=None, blob: bytes | None = None):
        import torch

        if blob is not None:
            self._n = struct.unpack_from("<q", blob, 24)[0]  # BlobHeader.n (sparse_gemm.cpp)
            buf = ctypes.create_string_buffer(blob, len(blob))
            h = lib().es_sparse_gemm_create_from_blob(buf, len(blob), _stream())
        else:
            w = weight.contiguous()
            self._n = w.shape[0]
            h = lib().es_sparse_gemm_create(_torch_dtype_code(w), w.shape[0], w.shape[1], w.data_ptr(), _stream())
        if not h:
            raise KernelError(lib().es_last_error().decode())
        self._h = ctypes.c_void_p(h)
        self._ws = torch.empty(0, dtype=torch.uint8, device="cuda")
        self.config = -1

    def __del__(self):
        h = getattr(self, "_h", None)
        if h:
            lib().es_sparse_gemm_destroy(h)

    def _workspace(self, m: int):
        import torch

        need = ctypes.c_size_t()
        _check(lib().es_sparse_gemm_workspace_size(self._h, m, self.config, ctypes.byref(need)))
        if need.value > self._ws.numel():
            self._ws = torch.empty(need.value, dtype=torch.uint8, device="cuda")
        return self._ws

    def __call__(self, x, out=None):
        import torch

        M = x.shape[0]
        if out is None:
            out = torch.empty(M, self.n, dtype=x.dtype, device=x.device)
        ws = self._workspace(M)
        _check(lib().es_sparse_gemm_run(self._h, x.data_ptr(), out.data_ptr(), M, ws.data_ptr(), ws.numel(), self.config,
                                        _stream()))
        return out

    def algorithm_count(self, m: int) -> int:
        """How many kernel configurations cuSPARSELt has for this M (ids 0 .. count - 1)."""
        count = ctypes.c_int()
        _check(lib().es_sparse_gemm_algorithm_count(self._h, m, ctypes.byref(count)))
        return count.value

    @property
    def n(self) -> int:
        return self._n

    def export(self) -> bytes:
        size = ctypes.c_size_t()
        _check(lib().es_sparse_gemm_export(self._h, None, ctypes.byref(size), _stream()))
        buf = ctypes.create_string_buffer(size.value)
        _check(lib().es_sparse_gemm_export(self._h, buf, ctypes.byref(size), _stream()))
        return buf.raw[: size.value]
