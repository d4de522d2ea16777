"""KV-cache scales: static per (layer, KV head, channel) scales of quantized KV pages, calibrated by
running the graph the paged lowering starts from (com.enginesmith.GroupQueryAttention over shared
KV buffers, ort_attention's output) on calibration text through the ORT ops' CPU kernels (or their CUDA
kernels: ENGINESMITH_KV_CALIB_DEVICE=cuda, see calib_device).

Dimension legend: N calibration windows, S tokens per window, H query heads, Hkv KV heads, D head
size (h = D / 2), C the graph's KV capacity.

Per layer the op's packed input qkv [1, S, (H + 2 Hkv) D] holds K before the rotary embedding and V:

    K pairs (k[d], k[d + h]) are rotated by RoPE, which keeps each pair's norm: the largest post-RoPE
    |k[d]| at any position is at most max_t ‖(k[d], k[d + h])‖, reached as the angle sweeps. So K's
    bound of channel d (and d + h) is that pair norm's maximum over the calibration tokens (exact
    for every position, unlike the maximum at the positions the text happened to have).
    V's bound of channel d is max_t |v[d]|.

scale = bound * headroom / code_max (int8: 127, headroom 1: the calibration maximum is the code
maximum; fp8 e4m3: 448, headroom 2: its relative precision is the same at every normal magnitude,
so halving the range costs nothing there and leaves room for larger values). Channels that stayed 0
get a tiny scale. Measured on SmolLM2 (HF torch, 4096 tokens of Pride and Prejudice, 8 x 512 tokens
of Emma): int8 per channel +0.03 % perplexity, per head +0.28 %; fp8 per channel +0.48 %, per head +1.3 %.
Results are cached under cache_dir()/calib by (graph hash, calibration set, windows).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.paths import cache_dir
from enginesmith.core.progress import bar as progress_bar
from enginesmith.passes.analysis.calibrate import CalibrationSet, graph_hash, open_session

CODE_MAX = {"int8": 127.0, "fp8": 448.0}
HEADROOM = {"int8": 1.0, "fp8": 2.0}
TINY = 1e-6        # the bound of a channel that stayed 0
SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"


@dataclass(frozen=True)
class KvBounds:
    """Per layer: K's pair-norm bound and V's absmax, each [Hkv, D] float32."""

    key: np.ndarray
    value: np.ndarray


def scales(bounds: KvBounds, kv_dtype: str) -> np.ndarray:
    """kv_scale [2, Hkv, D] float32 of one layer for `kv_dtype` ("int8" | "fp8")."""
    both = np.stack([bounds.key, bounds.value]).astype(np.float32)
    return (np.maximum(both, TINY) * HEADROOM[kv_dtype] / CODE_MAX[kv_dtype]).astype(np.float32)


def bounds_of(qkv: np.ndarray, heads: int, kv_heads: int) -> KvBounds:
    """K's pair-norm and V's absmax bounds [Hkv, D] of qkv [..., (H + 2 Hkv) D] over all tokens."""
    x = qkv.reshape(-1, heads + 2 * kv_heads, qkv.shape[-1] // (heads + 2 * kv_heads)).astype(np.float32)
    k, v = x[:, heads:heads + kv_heads], x[:, heads + kv_heads:]
    h = k.shape[-1] // 2
    pair = np.sqrt(k[..., :h] ** 2 + k[..., h:] ** 2).max(0)  # [Hkv, h]
    return KvBounds(np.concatenate([pair, pair], -1), np.abs(v).max(0))


def collect(onnx_path: Path, layers: list[tuple[str, int, int]], calib: CalibrationSet, windows: int,
            capacity: int, ops_lib: Path, progress: bool = True) -> list[KvBounds]:
    """KvBounds of each layer (qkv tensor name, H, Hkv) of the GQA graph at `onnx_path` (KV capacity
    `capacity`: its rotary tables' positions) over the first `windows` calibration windows, each cut to
    the capacity (cached)."""
    onnx_path = Path(onnx_path)
    used = calib.windows[:windows, :capacity]
    key = f"kv-{graph_hash(onnx_path)}-{calib.key}-n{len(used)}-s{used.shape[1]}"
    cache = cache_dir() / "calib" / f"{key}.npz"
    names = [name for name, _, _ in layers]
    if cache.is_file():
        with np.load(cache) as f:
            if all(f"k:{n}" in f and f"v:{n}" in f for n in names):
                return [KvBounds(f[f"k:{n}"], f[f"v:{n}"]) for n in names]
    found: dict[str, KvBounds] = {}
    for outs in _run(onnx_path, names, used, ops_lib, progress):
        for (name, heads, kv_heads), x in zip(layers, outs):
            b = bounds_of(x, heads, kv_heads)
            old = found.get(name)
            found[name] = b if old is None else KvBounds(np.maximum(old.key, b.key), np.maximum(old.value, b.value))
    cache.parent.mkdir(parents=True, exist_ok=True)
    arrays = {f"{kind}:{n}": getattr(found[n], attr) for n in names for kind, attr in (("k", "key"), ("v", "value"))}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=cache.parent)
    os.close(fd)
    try:
        np.savez(tmp, **arrays)
        os.replace(tmp, cache)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return [found[n] for n in names]


def attention_scales(who: str, nodes: list, kv_dtype: str, windows: int, ctx, capacity: int) -> list[np.ndarray]:
    """kv_scale [2, Hkv, D] of each com.enginesmith.GroupQueryAttention node in `nodes` (its packed qkv input
    and head counts), calibrated on the input graph of the pass `who` (its PassContext `ctx`)."""
    if ctx is None or ctx.calibration is None:
        raise UserError(f"{who} kv_dtype={kv_dtype} calibrates its KV scales and got no calibration data",
                        "run it through the pass pipeline with a calibration set")
    from enginesmith.plugins import ort_ops  # deferred: the library is needed only to calibrate

    layers = [(node.inputs[0].name, int(node.attributes["num_heads"].value),
               int(node.attributes["kv_num_heads"].value)) for node in nodes]
    bounds = collect(ctx.model_path, layers, ctx.calibration, windows, capacity, ort_ops.require(),
                     progress=ctx.progress)
    return [scales(b, kv_dtype) for b in bounds]


def calib_device() -> str:
    """Where the KV bounds are collected: $ENGINESMITH_KV_CALIB_DEVICE, cpu (default) or cuda. The graph
    has been lowered for CUDA by then (GEMVs and attention are enginesmith's ops), and the CPU kernels of
    those ops are the scalar references: a 1B model's window of calibration tokens takes minutes there
    (none of 8 windows finished in 400 s on a 16-core machine), and about a second through the CUDA
    kernels. The bounds agree to fp16 rounding; the cached ones are reused whichever device made them."""
    device = os.environ.get("ENGINESMITH_KV_CALIB_DEVICE", "cpu")
    if device not in ("cpu", "cuda"):
        raise UserError(f"ENGINESMITH_KV_CALIB_DEVICE={device!r} is not a device", "set it to cpu or cuda")
    return device


def _run(onnx_path: Path, names: list[str], windows: np.ndarray, ops_lib: Path, progress: bool):
    """Yield the tensors `names` for each window, each run from an empty cache (rows of one window)."""
    import onnx  # deferred: heavy, only when the bounds are not cached

    session = open_session(onnx_path, names, onnx.TensorProto.FLOAT16, ops_lib, device=calib_device())
    inputs = {i.name: i for i in session.get_inputs()}
    if SEQLENS not in inputs or TOTAL not in inputs:
        raise UserError(f"{onnx_path} has no {SEQLENS} / {TOTAL} inputs: KV scales are calibrated on the "
                        "shared-buffer GQA graph", "run lower_gqa and ort_attention before paged_gqa")
    seq = windows.shape[1]
    pasts = {}  # KV buffers of the window's length (within the capacity: the caller cut the windows)
    for name, inp in inputs.items():
        if io_names.is_past(name):
            dtype = np.float16 if "float16" in inp.type else np.float32
            pasts[name] = np.zeros((1, int(inp.shape[1]), seq, int(inp.shape[3])), dtype)
    for window in progress_bar(iterable=windows, desc="calibrating KV scales", unit="window", disable=not progress,
                               leave=False):
        feeds = dict(pasts, input_ids=np.asarray(window, np.int64)[None],
                     **{SEQLENS: np.array([seq - 1], np.int32), TOTAL: np.array(seq, np.int32)})
        yield session.run(names, feeds)


__all__ = ["CODE_MAX", "HEADROOM", "KvBounds", "bounds_of", "calib_device", "collect", "scales"]
