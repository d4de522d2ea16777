"""Helpers shared by the pass tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def ort_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Logits of a prefill of `ids` [B, S] from an empty cache (ORT CPU, default optimizations;
    W8A8 graphs then run on ORT's int8 kernels)."""
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    engine = OrtEngine(path, device="cpu")
    batch, seq = ids.shape
    mask = np.ones((batch, seq), np.int64)
    pos = np.broadcast_to(np.arange(seq), (batch, seq)).copy()
    return engine.forward(ids, mask, pos, engine.new_cache(batch))


def graph_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Logits as the graph means them: ORT with its Q/DQ fusion off (fake quantization with exact
    accumulation, as TensorRT computes INT8). ORT's fused CPU int8 kernels can saturate on x86
    without VNNI, so accuracy bounds of W8A8 graphs are checked here."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_quant_qdq", "1")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    batch, seq = ids.shape
    feeds = {i.name: np.zeros((batch, int(i.shape[1]), 0, int(i.shape[3])), np.float32)
             for i in session.get_inputs() if i.name.startswith("past_key_values.")}
    feeds.update(input_ids=ids, attention_mask=np.ones((batch, seq), np.int64),
                 position_ids=np.broadcast_to(np.arange(seq), (batch, seq)).copy())
    return session.run(["logits"], feeds)[0]
