"""Sink + window ring KV cache (StreamingLLM) for graphs rewritten by the kv_ring pass.

Dimension legend: B batch, S new tokens, s sinks, w window, C = s + w slots, Hkv, D.

Policy. A row's tokens are numbered t = 0, 1, ... as they arrive (padding excluded). The cache
keeps the first s tokens (attention sinks) and the last w tokens; a forward call writes its chunk
first (evicting the oldest window entries it needs room for) and then attends to the whole cache,
as StreamingLLM's `evict_for_space` + append. So a chunk holds at most w tokens.

Slots, in the order the graph concatenates them for attention:

    [ sink 0 .. sink s-1 | window 0 .. window w-1 ]      token t >= s lives in window (t - s) % w

Positions are positions in the cache, not in the stream: sinks 0..s-1, then the window's tokens
oldest first s, s+1, ...; a query's position is its own slot's. They stay below C however long
the stream runs. What the graph is fed per step (computed here, on the host, O(B*C)):

    attention_mask [B, C]   1 where the slot holds a token after this step's write
    cache_positions [B, C]  each slot's position (0 for empty slots)
    position_ids [B, S]     each new token's position (0 for padding)
    write_indices [B]       window slot of the chunk's first column ((t0 - s) % w, t0 may be < 0)
    sink_sources [B, s]     chunk column that fills sink j now, or -1

Padding: rows are left-padded (generate does that) and padding may only come before a row's
first token. Pad columns get negative token numbers, so they are written to window slots that are
empty at that time and never marked occupied. A chunk of S <= w columns touches S distinct window
slots, so pads never overwrite a token of their own chunk.

Memory: per layer the window K and V buffers [B, Hkv, w, D] are bound as both the past input and
the present output (TensorScatter updates them in place), and the sink buffers [B, Hkv, s, D] are
double-buffered; nothing is allocated after construction and nothing grows.
"""

from __future__ import annotations

import json

import numpy as np

from enginesmith.core import io_names, kv_spec
from enginesmith.core.kv_layout import ring_feeds
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


class RingKVCache:
    """Fixed-size sink + window cache; `feeds` for the step, `bind` its buffers, `advance` after."""

    rollback = False  # an evicted token cannot come back: truncate raises
    evicts = True

    def __init__(self, sinks: int, window: int, names: dict[str, list[str]], batch: int, kv_heads: int,
                 head_dim: int, dtype, device: str, device_id: int = 0):
        if window < 1 or sinks < 0:
            raise UserError(f"invalid ring cache sinks={sinks} window={window}",
                            "use sinks >= 0 and a window >= 1")
        self.sinks, self.window = sinks, window
        self.names = names
        self.device, self.device_id = device, device_id
        self.dtype = np.dtype(dtype)

        def buffer(slots):  # zeros: empty slots are masked, but NaN garbage would still poison q.k
            return ort.OrtValue.ortvalue_from_numpy(np.zeros((batch, kv_heads, slots, head_dim), dtype),
                                                    device, device_id)

        self.windows = [buffer(window) for _ in names["past"]]
        self.sink_buffers = [[buffer(sinks) for _ in names["past_sinks"]] for _ in range(2)]
        self._front = 0  # which sink buffer set holds the current sinks
        self.count = np.zeros(batch, dtype=np.int64)  # tokens each row has seen
        self._pending: np.ndarray | None = None
        self.exact_chunk = window  # a sliding-window graph's limit (for_session reads it)

    @classmethod
    def for_session(cls, session: ort.InferenceSession, batch: int, device: str) -> "RingKVCache":
        """A cache shaped for a ring graph, sizes read from its inputs."""
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = [o.name for o in session.get_outputs()]
        past = [n for n in inputs if io_names.is_past(n)]
        past_sinks = [n for n in inputs if io_names.is_past_sinks(n)]
        first = inputs[past[0]]
        window = int(first.shape[2])
        sinks = int(inputs[past_sinks[0]].shape[2]) if past_sinks else 0
        names = {"past": past, "present": [io_names.present_of(p) for p in past],
                 "past_sinks": past_sinks,
                 "present_sinks": [io_names.present_of(p) for p in past_sinks]}
        missing = [n for n in names["present"] + names["present_sinks"] if n not in outputs]
        if missing:
            raise UserError(f"the ring graph lacks outputs {missing[:2]}", "rebuild the engine")
        cache = cls(sinks, window, names, batch, int(first.shape[1]), int(first.shape[3]), _NP[first.type], device)
        cache.exact_chunk = _exact_chunk(session, window)
        return cache

    # ------------------------------------------------------------------ sizes

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @property
    def max_chunk(self) -> int:
        """The most tokens one forward call may write (the engine splits longer prefills). A ring that
        is a model's sliding window of W positions stays exact only for chunks of window - W + 1 tokens
        (the pass records it as max_exact_chunk)."""
        return max(1, min(self.window, self.exact_chunk))

    @property
    def batch(self) -> int:
        return len(self.count)

    @property
    def length(self) -> int:
        """Tokens held now by the fullest row (never more than the capacity)."""
        return int(np.minimum(self.count, self.capacity).max()) if len(self.count) else 0

    def nbytes(self) -> int:
        """Bytes of every cache buffer (fixed at construction)."""
        values = self.windows + self.sink_buffers[0] + self.sink_buffers[1]
        return int(sum(np.prod(v.shape()) for v in values)) * self.dtype.itemsize

    # ------------------------------------------------------------------ one step

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        """The ring's inputs for a step whose new tokens are the last S columns of the dense-style
        attention_mask [B, P+S] (0 = padding); position_ids [B, S] only gives S."""
        batch, cols = position_ids.shape
        if batch != self.batch:
            raise UserError(f"a batch of {batch} rows was fed to a cache made for {self.batch}",
                            "make the cache with engine.new_cache(batch)")
        if cols > self.window:
            raise UserError(f"a chunk of {cols} tokens does not fit the KV window of {self.window}",
                            f"feed at most {self.window} tokens per step (the engine splits prompts), "
                            "or build with a larger --kv-window")
        real = np.asarray(attention_mask)[:, -cols:].astype(bool)
        new = real.sum(axis=1).astype(np.int64)
        pads = cols - new
        if np.any(real[:, :-1] & ~real[:, 1:]):
            raise UserError("padding after a real token in a ring-cache step", "left-pad the prompts")
        if np.any((pads > 0) & (self.count > 0)):
            raise UserError("padding fed to a row that already holds tokens",
                            "pad only a row's first chunk (left padding)")
        feeds, total = ring_feeds(self.count, self.sinks, self.window, real)
        self._pending = total
        return feeds

    def bind(self, binding: ort.IOBinding, device: str, device_id: int = 0) -> None:
        """Window buffers are input and output at once (in place); sinks read front, write back."""
        for past, present, value in zip(self.names["past"], self.names["present"], self.windows):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        front, back = self.sink_buffers[self._front], self.sink_buffers[1 - self._front]
        for past, present, src, dst in zip(self.names["past_sinks"], self.names["present_sinks"], front, back):
            binding.bind_ortvalue_input(past, src)
            binding.bind_ortvalue_output(present, dst)

    def advance(self, presents: list[ort.OrtValue]) -> None:
        """Commit the step whose feeds were taken (the buffers were written in place)."""
        assert self._pending is not None, "advance() without feeds()"
        self.count = self._pending
        self._pending = None
        if self.sinks:
            self._front = 1 - self._front

    def reset(self) -> None:
        """Forget every row's tokens (the buffers are reused; empty slots are never attended)."""
        self.count[:] = 0
        self._pending = None

    def select(self, rows: np.ndarray) -> None:
        """Keep only batch rows `rows` (drop finished sequences)."""
        rows = np.asarray(rows)

        def take(value):
            return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value.numpy()[rows]),
                                                    self.device, self.device_id)

        self.windows = [take(v) for v in self.windows]
        self.sink_buffers = [[take(v) for v in group] for group in self.sink_buffers]
        self.count = self.count[rows].copy()

    def truncate(self, length: int) -> None:
        raise UserError("the ring KV cache cannot roll back tokens", "use the dense KV layout for "
                        "speculative decoding")


KV_LAYOUT_KEY = kv_spec.GRAPH_KEY  # the graph metadata the KV passes write (passes/kv)


def _exact_chunk(session: ort.InferenceSession, window: int) -> int:
    """The graph's max_exact_chunk (a sliding-window ring), else the window; the metadata is
    untrusted: anything but a positive integer there is ignored."""
    raw = session.get_modelmeta().custom_metadata_map.get(KV_LAYOUT_KEY, "")
    if not raw or len(raw) > 4096:
        return window
    try:
        value = json.loads(raw).get("max_exact_chunk", window)
    except (ValueError, AttributeError):
        return window
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else window
