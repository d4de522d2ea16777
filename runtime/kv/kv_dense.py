"""Dense KV cache for graphs that grow the cache by concatenation (past -> present).

Per layer, key and value are [B, Hkv, P, D] OrtValues living on the engine's device: present
outputs are bound as OrtValues and fed back as the next step's past, so on CUDA the cache never
crosses to the host. `length` is P, the number of cached positions (left padding included).
"""

from __future__ import annotations

import numpy as np

from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed


_ITEMSIZE = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(bfloat16)": 2}


class DenseKVCache:
    """The protocols.KVCache of a concatenating graph: rollback by copy, nothing evicted."""

    rollback = True
    evicts = False
    max_chunk = None  # any number of tokens per call

    def __init__(self, past_names: list[str], present_names: list[str], values: list[ort.OrtValue]):
        assert len(past_names) == len(present_names) == len(values)
        self.past_names = past_names
        self.present_names = present_names
        self.values = values

    @classmethod
    def empty(cls, past_names, present_names, batch: int, kv_heads: int, head_dim: int,
              dtype: np.dtype, device: str, device_id: int = 0) -> "DenseKVCache":
        shape = (batch, kv_heads, 0, head_dim)
        values = [ort.OrtValue.ortvalue_from_shape_and_type(shape, dtype, device, device_id)
                  for _ in past_names]
        return cls(list(past_names), list(present_names), values)

    @property
    def batch(self) -> int:
        return self.values[0].shape()[0]

    @property
    def length(self) -> int:
        return self.values[0].shape()[2]

    def nbytes(self) -> int:
        """Bytes of every layer's key and value now (grows with the positions)."""
        return sum(int(np.prod(v.shape())) * _ITEMSIZE[v.data_type()] for v in self.values)

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The step's mask and positions, as given (the graph reads them directly)."""
        return {"attention_mask": attention_mask, "position_ids": position_ids}

    def bind(self, binding: ort.IOBinding, device: str, device_id: int = 0) -> None:
        """Bind the cache as past inputs and ask for presents on the same device."""
        for name, value in zip(self.past_names, self.values):
            binding.bind_ortvalue_input(name, value)
        for name in self.present_names:
            binding.bind_output(name, device, device_id)

    def advance(self, presents: list[ort.OrtValue]) -> None:
        """Take the presents of the step just run as the new cache."""
        assert len(presents) == len(self.values)
        self.values = presents

    def truncate(self, length: int) -> None:
        """Drop positions >= length (speculative decoding rollback)."""
        if length >= self.length:
            return
        device = self.values[0].device_name()
        self.values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[:, :, :length]), device)
                       for v in self.values]

    def select(self, rows: np.ndarray) -> None:
        """Keep only batch rows `rows` (drop finished sequences)."""
        device = self.values[0].device_name()
        self.values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows]), device)
                       for v in self.values]
