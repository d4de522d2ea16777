"""What the decode loops may ask of an engine and of its KV cache, and what an opened engine is.

Every engine (OrtEngine, GqaEngine, TrtEngine) and every KV cache (DenseKVCache, RingKVCache,
PagedKVCache, SharedKVCache, TrtKVCache) declares its capabilities as class attributes; the loops
read those instead of probing with hasattr:

    engine.device            "cpu" | "cuda": where it runs (and where --compare puts the HF model)
    engine.device_decode     greedy_forward(ids, cache) and ort_cuda.fast_generate_ids run on it
    cache.rollback           truncate(length) drops positions >= length (speculative decoding)
    cache.evicts             fixed size, old tokens leave (the ring): `capacity` slots, at most
                             `max_chunk` tokens a call; a stream may run past the model's context
    cache.nbytes()           bytes of the cache's buffers now

Dimension legend: B batch, S new tokens, P cached positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import numpy as np

from enginesmith.core.manifest import KVLayout, Manifest


class KVCache(Protocol):
    """A KV cache of `batch` rows holding `length` positions (left padding included)."""

    rollback: ClassVar[bool]
    evicts: ClassVar[bool]

    @property
    def batch(self) -> int: ...

    @property
    def length(self) -> int: ...

    def truncate(self, length: int) -> None:
        """Drop positions >= length; a cache with rollback False raises a UserError."""

    def nbytes(self) -> int: ...


class OrtCache(Protocol):
    """What OrtEngine.forward asks of the cache it is given (KV caches and the paged pool)."""

    max_chunk: int | None  # the most tokens one call may write (longer inputs run in chunks); None: any

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's mask/position inputs for a step (the dense cache passes them through)."""

    def bind(self, binding: Any, device: str, device_id: int = 0) -> None: ...

    def advance(self, presents: list) -> None: ...


class Engine(Protocol):
    """forward(ids, mask, positions, cache) -> logits [B, S, V] float32; the cache advances in place."""

    vocab: int
    device: str
    device_decode: ClassVar[bool]

    def new_cache(self, batch: int) -> KVCache: ...

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: Any) -> np.ndarray: ...


@dataclass
class LoadedEngine:
    """An opened engine directory (runtime.load.open_engine): its manifest, engine and tokenizer."""

    path: Path
    manifest: Manifest
    engine: Engine
    tokenizer: Any

    @property
    def max_positions(self) -> int:
        return self.manifest.max_positions

    @property
    def pad_id(self) -> int:
        return self.manifest.model.pad_token_id or 0

    @property
    def kv_layout(self) -> KVLayout:
        return self.manifest.kv_layout

    @property
    def context_limit(self) -> int | None:
        """Most tokens one sequence may hold: the model's context, None for a ring cache (streams)."""
        return None if self.kv_layout.type == "ring" else self.max_positions
