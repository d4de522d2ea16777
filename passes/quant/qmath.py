"""Quantization arithmetic (numpy), shared by the passes and by the searches that emulate them.

All symmetric, zero point 0. Weights are handled as [K, N] (K = input channels):
  int8 per output channel   scale[n] = max_k |W[k, n]| / 127,          q in [-127, 127]
  int4 blocks along K       scale[b, n] = max_{k in block b} |W| / 7,   q in [-8, 7] (-8 unused)
  int8 per tensor (acts)    scale = max |X| / 127
"""

from __future__ import annotations

import numpy as np

INT8_MAX = 127.0
INT4_MAX = 7.0
_TINY = 1e-12


def int8_per_channel(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 [K, N], scale float32 [N])."""
    scale = np.maximum(np.abs(w_kn).max(axis=0), _TINY) / INT8_MAX
    q = np.clip(np.rint(w_kn / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale.astype(np.float32)


def fake_int8_per_channel(w_kn: np.ndarray) -> np.ndarray:
    q, scale = int8_per_channel(w_kn)
    return q.astype(np.float32) * scale


def act_scale(tensor_max: float) -> float:
    """Per-tensor int8 scale for an activation whose calibrated max |X| is `tensor_max`."""
    return max(float(tensor_max), _TINY) / INT8_MAX


def fake_int8_act(x: np.ndarray, scale: float) -> np.ndarray:
    return np.clip(np.rint(x / scale), -INT8_MAX, INT8_MAX) * scale


def blocks(k: int, block_size: int) -> int:
    return -(-k // block_size)


def int4_blocks(w_kn: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 values in [-8, 7] [K, N], scale float32 [ceil(K / block_size), N]); a last partial
    block is allowed (DequantizeLinear-21 takes ceil(K / block_size) scales)."""
    k, n = w_kn.shape
    nb = blocks(k, block_size)
    padded = np.zeros((nb * block_size, n), dtype=np.float32)
    padded[:k] = w_kn
    per_block = padded.reshape(nb, block_size, n)
    scale = np.maximum(np.abs(per_block).max(axis=1), _TINY) / INT4_MAX  # [nb, N]
    q = np.clip(np.rint(per_block / scale[:, None, :]), -8, INT4_MAX).astype(np.int8)
    return q.reshape(nb * block_size, n)[:k], scale.astype(np.float32)


def fake_int4_blocks(w_kn: np.ndarray, block_size: int) -> np.ndarray:
    q, scale = int4_blocks(w_kn, block_size)
    return q.astype(np.float32) * np.repeat(scale, block_size, axis=0)[: w_kn.shape[0]]


def relative_error(y: np.ndarray, ref: np.ndarray) -> float:
    """||y - ref||^2 / ||ref||^2."""
    return float(np.square(y - ref).sum() / max(float(np.square(ref).sum()), _TINY))
