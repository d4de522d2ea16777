"""An Engine over an ONNX Runtime session.

CPU EP everywhere; CUDA EP when onnxruntime-gpu is installed (provider="auto" picks it). Inputs
and outputs go through one IOBinding per call; the KV cache stays on the session's device.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from enginesmith.core import io_names, kv_spec
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.plugins import ort_ops
from enginesmith.runtime.kv.kv_dense import DenseKVCache
from enginesmith.runtime.kv.kv_paged import PagedKVCache
from enginesmith.runtime.kv.kv_h2o import H2OKVCache
from enginesmith.runtime.kv.kv_ring import RingKVCache
from enginesmith.runtime.protocols import KVCache, OrtCache

_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(bfloat16)": None}


def resolve_device(requested: str) -> str:
    """"auto" | "cpu" | "cuda" -> the device a session will use, or a UserError."""
    available = ort.get_available_providers()
    if requested == "auto":
        return "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if requested == "cuda" and "CUDAExecutionProvider" not in available:
        raise UserError("CUDA was requested but this onnxruntime has no CUDA execution provider",
                        'pip uninstall -y onnxruntime && pip install "enginesmith[cuda]", or use --device cpu')
    if requested not in ("cpu", "cuda"):
        raise UserError(f"unknown device {requested!r}", "use --device auto, cpu or cuda")
    return requested


class OrtEngine:
    """forward(ids, mask, positions, cache) -> logits; the cache is advanced in place."""

    device_decode = False  # no device loop: every step's logits come to the host

    def __init__(self, onnx_path: str | Path, device: str = "auto", threads: int | None = None,
                 optimization: str = "all") -> None:
        self.device = resolve_device(device)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = {
            "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
            "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
            "none": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        }[optimization]
        # Keep blocked-int4 MatMuls at fp accuracy: ORT's default would quantize activations to int8.
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
        if threads:
            opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        providers = ["CPUExecutionProvider"]
        if self.device == "cuda":
            if hasattr(ort, "preload_dlls"):
                ort.preload_dlls()
            providers = [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
        ort_ops.register_for(opts, onnx_path)  # graphs rewritten by passes/ort_gemv.py, ort_attention.py
        self.session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if io_names.is_past(n)]
        self.present_names = [o.name for o in self.session.get_outputs() if io_names.is_present(o.name)]
        first = inputs[self.past_names[0]]
        self.kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[3])
        self.kv_dtype = _NP_DTYPES[first.type]
        logits = self.session.get_outputs()[0]
        self.vocab = int(logits.shape[-1])
        try:  # the layout the KV passes recorded in the graph (core/kv_spec.py); input names decide nothing
            layout = kv_spec.graph_layout(self.session.get_modelmeta().custom_metadata_map)
        except ValueError as exc:
            raise UserError(f"{onnx_path}: {exc}", "rebuild the engine") from None
        self.kv_layout, self.kv_policy = layout["type"], layout.get("policy", "streaming")
        scores = any(o.name.startswith(io_names.ATTENTION_SCORES) for o in self.session.get_outputs())
        if scores != (self.kv_layout == "ring" and self.kv_policy == "h2o"):
            raise UserError(f"{onnx_path}: its attention-score outputs and its recorded KV layout {layout} disagree",
                            "rebuild the engine")

    def new_cache(self, batch: int) -> KVCache:
        """DenseKVCache, or the Ring/Paged cache for a graph rewritten by kv_ring / kv_paged."""
        if self.kv_layout == "ring" and self.kv_policy == "h2o":
            return H2OKVCache.for_session(self.session, batch, self.device)  # kv_h2o: heavy-hitter eviction
        if self.kv_layout == "ring":
            return RingKVCache.for_session(self.session, batch, self.device)
        if self.kv_layout == "paged":
            return PagedKVCache.for_session(self.session, batch, self.device)
        return DenseKVCache.empty(self.past_names, self.present_names, batch, self.kv_heads,
                                  self.head_dim, self.kv_dtype, self.device)

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: OrtCache) -> np.ndarray:
        """Run one step. input_ids/position_ids [B, S], attention_mask [B, P+S]; logits [B, S, V] fp32.

        The cache gives the step's feeds (`cache.feeds(mask, positions)`: the dense cache passes
        them through, the ring cache turns them into slot occupancy and positions in the cache) and
        may cap the tokens per call (`cache.max_chunk`): longer inputs run as consecutive chunks."""
        limit = cache.max_chunk
        seq = input_ids.shape[1]
        if limit and seq > limit:
            past = attention_mask.shape[1] - seq
            return np.concatenate([
                self.forward(input_ids[:, i:i + limit], attention_mask[:, :past + min(i + limit, seq)],
                             position_ids[:, i:i + limit], cache) for i in range(0, seq, limit)], axis=1)
        feeds = cache.feeds(attention_mask, position_ids)
        binding = self.session.io_binding()
        for name, array in (("input_ids", input_ids), *feeds.items()):
            binding.bind_cpu_input(name, np.ascontiguousarray(array, dtype=np.int64))
        binding.bind_output("logits", "cpu")
        cache.bind(binding, self.device)
        self.session.run_with_iobinding(binding)
        outputs = binding.get_outputs()
        cache.advance(outputs[1:])
        return outputs[0].numpy().astype(np.float32, copy=False)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
