"""Heavy-hitter (H2O) KV cache of constant size, for ring graphs with attention scores (kv_h2o).

Dimension legend: B batch, S new tokens, H query heads, C = budget slots, L layers.

Policy (Zhang et al. 2023, "H2O"), with one eviction shared by every layer and head (the graph
writes a step's tokens at one slot index per row): each slot accumulates the attention mass it
receives, summed over the step's queries, heads and layers. While the cache has free slots, a
chunk fills them in order. Once it is full, tokens come one per step and each evicts the slot of
least accumulated attention among those that are not among the `recent` newest tokens:

    slots  [ t=0 | t=17 | t=3 | t=42 | ... ]     score[c] += Σ_layers Σ_heads Σ_queries p(query -> c)
    evict  argmin score over slots whose token is older than the `recent` newest

Positions are positions in the cache, as in the ring (StreamingLLM): the held tokens sorted by
arrival get 0..n-1, so a stream of any length stays inside the trained context; keys are stored
unrotated and the graph rotates them by `cache_positions` every step. Memory is fixed at
construction: per layer K and V [B, Hkv, C, D] (bound in place), plus [B, C] bookkeeping.
Rows must not be padded (equal-length prompts); batch rows evict independently.
"""

from __future__ import annotations

import numpy as np

from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class H2OKVCache:
    """Constant-size cache that evicts the least-attended slot; `feeds`, `bind`, `advance` per step."""

    rollback = False
    evicts = True
    sinks = 0

    def __init__(self, budget: int, names: dict[str, list[str]], batch: int, kv_heads: int, head_dim: int,
                 dtype, device: str, recent: int | None = None, device_id: int = 0):
        if budget < 2:
            raise UserError(f"an H2O cache of {budget} slots is too small", "use --kv-budget 2 or more")
        self.window = budget                       # the ring graph's slots (measure/streaming reads it)
        self.recent = budget // 2 if recent is None else recent
        if not 0 <= self.recent < budget:
            raise UserError(f"H2O keeps {self.recent} recent tokens of a budget of {budget}",
                            "keep fewer recent tokens than the budget (default: half)")
        self.names, self.device, self.device_id = names, device, device_id
        self.dtype = np.dtype(dtype)
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, kv_heads, budget, head_dim), dtype),
                                                         device, device_id) for _ in names["past"]]
        self.token = np.full((batch, budget), -1, np.int64)    # arrival number of the slot's token, -1 empty
        self.score = np.zeros((batch, budget))                 # accumulated attention mass
        self.count = np.zeros(batch, np.int64)                 # tokens each row has seen
        self._pending: np.ndarray | None = None                # token numbers after this step

    @classmethod
    def for_session(cls, session: ort.InferenceSession, batch: int, device: str,
                    recent: int | None = None) -> "H2OKVCache":
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        past = [n for n in inputs if io_names.is_past(n)]
        scores = [n for n in outputs if n.startswith(io_names.ATTENTION_SCORES)]
        if not scores or any(io_names.is_past_sinks(n) for n in inputs):
            raise UserError("this engine is not an H2O graph (a ring of no sinks with attention scores)",
                            "build it with --kv h2o")
        first = inputs[past[0]]
        names = {"past": past, "present": [io_names.present_of(p) for p in past],
                 "scores": sorted(scores, key=lambda n: int(n.rsplit(".", 1)[1]))}
        return cls(int(first.shape[2]), names, batch, int(first.shape[1]), int(first.shape[3]),
                   _NP[first.type], device, recent)

    @property
    def capacity(self) -> int:
        return self.window

    @property
    def max_chunk(self) -> int:
        """Free slots of the fullest row, or 1 once full (each token then evicts one slot)."""
        return max(1, self.window - self.length)

    @property
    def batch(self) -> int:
        return len(self.count)

    @property
    def length(self) -> int:
        return int((self.token >= 0).sum(axis=1).max()) if self.batch else 0

    def nbytes(self) -> int:
        return int(sum(np.prod(v.shape()) for v in self.buffers)) * self.dtype.itemsize

    def victim(self, row: int) -> int:
        """The slot a new token of `row` overwrites: least attention among the non-recent tokens."""
        tokens = self.token[row]
        old = tokens < self.count[row] - self.recent
        return int(np.argmin(np.where(old, self.score[row], np.inf)))

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        batch, cols = position_ids.shape
        if batch != self.batch:
            raise UserError(f"a batch of {batch} rows was fed to a cache made for {self.batch}",
                            "make the cache with engine.new_cache(batch)")
        if not np.asarray(attention_mask)[:, -cols:].all():
            raise UserError("padding fed to an H2O cache", "feed rows of equal length (batch 1 for a stream)")
        tokens = self.token.copy()
        write = np.zeros(batch, np.int64)
        for b in range(batch):
            free = int((tokens[b] < 0).sum())
            if cols <= free:                      # still filling: the free slots are the last ones
                write[b] = self.window - free
            elif cols == 1:
                write[b] = self.victim(b)
            else:
                raise UserError(f"a chunk of {cols} tokens into a full H2O cache", "feed one token per step "
                                "once the cache is full (the engine splits prompts by max_chunk)")
            tokens[b, write[b]:write[b] + cols] = self.count[b] + np.arange(cols)
        occupied = tokens >= 0
        order = np.argsort(np.where(occupied, tokens, np.iinfo(np.int64).max), axis=1, kind="stable")
        rank = np.empty_like(order)
        np.put_along_axis(rank, order, np.arange(self.window)[None, :].repeat(batch, 0), axis=1)
        cache_pos = np.where(occupied, rank, 0)
        query_pos = np.take_along_axis(cache_pos, write[:, None] + np.arange(cols)[None, :], axis=1)
        self._pending = tokens
        return {io_names.ATTENTION_MASK: occupied.astype(np.int64), io_names.POSITION_IDS: query_pos,
                io_names.CACHE_POSITIONS: cache_pos.astype(np.int64), io_names.WRITE_INDICES: write}

    def bind(self, binding: ort.IOBinding, device: str, device_id: int = 0) -> None:
        for past, present, value in zip(self.names["past"], self.names["present"], self.buffers):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        for name in self.names["scores"]:
            binding.bind_output(name, "cpu")

    def advance(self, outputs: list) -> None:
        """Commit the step: new tokens in their slots, every slot's attention mass added."""
        assert self._pending is not None, "advance() without feeds()"
        scores = outputs[len(self.buffers):]
        assert len(scores) == len(self.names["scores"])
        mass = sum(np.asarray(s.numpy(), np.float64).sum(axis=1) for s in scores)     # [B, C]
        fresh = (self._pending >= 0) & (self._pending != self.token)
        self.score = np.where(fresh, 0.0, self.score) + mass
        self.count = self._pending.max(axis=1) + 1
        self.token = self._pending
        self._pending = None

    def reset(self) -> None:
        self.token[:] = -1
        self.score[:] = 0.0
        self.count[:] = 0
        self._pending = None

    def select(self, rows: np.ndarray) -> None:
        rows = np.asarray(rows)
        self.buffers = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy()[rows]), self.device,
                                                         self.device_id) for v in self.buffers]
        self.token, self.score, self.count = self.token[rows].copy(), self.score[rows].copy(), self.count[rows].copy()

    def truncate(self, length: int) -> None:
        raise UserError("the H2O KV cache cannot roll back tokens", "use the dense KV layout for speculative decoding")
