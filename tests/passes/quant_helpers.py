"""Helpers shared by the pass tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def ort_logits(path: Path, ids: np.ndarray) -> np.ndarray:
    """Logits of a prefill of `ids` [B, S] from an empty cache (ORT CPU, default optimizations)."""
    from enginesmith.runtime.ort_engine import OrtEngine

    engine = OrtEngine(path, device="cpu")
    batch, seq = ids.shape
    mask = np.ones((batch, seq), np.int64)
    pos = np.broadcast_to(np.arange(seq), (batch, seq)).copy()
    return engine.forward(ids, mask, pos, engine.new_cache(batch))
