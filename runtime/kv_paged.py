"""Paged KV cache for graphs rewritten by the kv_paged pass: page pools, block tables, slot mapping.

Dimension legend: B rows, S new tokens per row, NB pages in the pool, BS page size, MB pages per
row in the block table, Hkv key/value heads, D head size.

What a paged graph is fed per step (`PagedStep`, the layout of plugins/paged_attention):

    input_ids [B, S] int64        position_ids [B, S] int64 (RoPE position of each new token; pads 0)
    block_tables [B, MB] int32    page of each row's i-th block of BS positions; 0 = null page
    context_lens [B] int32        positions in the cache after this step's writes, counted as the
                                  kernel does: query column s sits at position context_lens - S + s
    slot_mapping [B, S] int32     page * BS + offset where column s's K/V is written; -1 = padding
    past_key_values.{i}.key/value [NB, BS, Hkv, D]  the pools, bound as input and output at once
    -> logits [B, S, V], present.{i}.key/value (the same pools, written in place)

Padding: rows of a step may hold fewer real tokens than S. Right padding (runtime.batching) keeps
`context_lens = computed + S`, so every query column has a valid position and no pad is ever
attended by a real token; the TensorRT plugin requires that (context_lens >= S). Left padding (what
`generate_ids` feeds) sets `context_lens = computed + real`, so pad columns get positions < 0 and
attend to nothing: fine for the ONNX Runtime lowerings, not for the plugin.

Page 0 is the null page: block tables are padded with it, nothing owns it (block_manager reserves
it), so reads past a row's tokens stay in bounds. Pools start zeroed (garbage could be NaN).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.runtime.block_manager import KVCacheManager

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
METADATA = ("block_tables", "context_lens", "slot_mapping")


@dataclass(frozen=True)
class PagedStep:
    block_tables: np.ndarray   # [B, MB] int32
    context_lens: np.ndarray   # [B] int32
    slot_mapping: np.ndarray   # [B, S] int32
    position_ids: np.ndarray   # [B, S] int64


def check_step(step: PagedStep, num_pages: int, page_size: int) -> None:
    """Refuse a step the kernels would answer wrongly: a page outside the pool, a context outside
    the block table, a slot that is not where the table puts that position."""
    tables, ctx, slots = step.block_tables, step.context_lens, step.slot_mapping
    batch, width = slots.shape
    if tables.ndim != 2 or tables.shape[0] != batch or ctx.shape != (batch,) or step.position_ids.shape != slots.shape:
        raise UserError(f"paged step shapes disagree: block_tables {tables.shape}, context_lens {ctx.shape}, "
                        f"slot_mapping {slots.shape}, position_ids {step.position_ids.shape}",
                        "give block_tables [B, MB], context_lens [B], slot_mapping and position_ids [B, S]")
    bad = np.argwhere((tables < 0) | (tables >= num_pages))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"block table out of range: row {row} entry {col} is page {tables[row, col]}, the pool "
                        f"has pages 0..{num_pages - 1}", "pad block tables with 0 (the null page) and "
                        "allocate pages through the block manager")
    capacity = tables.shape[1] * page_size
    bad = np.flatnonzero((ctx < 1) | (ctx > capacity))
    if len(bad):
        row = bad[0]
        raise UserError(f"context length {ctx[row]} of row {row} is outside [1, {capacity}] (block table of "
                        f"{tables.shape[1]} pages of {page_size})", "widen the block table to cover the context")
    bad = np.argwhere((slots < -1) | (slots >= num_pages * page_size))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"slot mapping out of range: row {row} column {col} is slot {slots[row, col]}, the pool "
                        f"has slots 0..{num_pages * page_size - 1}", "use page * page_size + offset, or -1 for padding")
    pos = ctx[:, None].astype(np.int64) - width + np.arange(width)[None, :]              # [B, S]
    real = slots >= 0
    if np.any(real & (pos < 0)):
        row, col = np.argwhere(real & (pos < 0))[0]
        raise UserError(f"row {row} column {col} writes a token at position {pos[row, col]} < 0",
                        "context_lens must count the row's real new tokens")
    page = np.take_along_axis(tables, np.clip(pos // page_size, 0, tables.shape[1] - 1), axis=1)
    expected = page * page_size + pos % page_size
    bad = np.argwhere(real & (slots != expected))
    if len(bad):
        row, col = bad[0]
        raise UserError(f"row {row} column {col} writes slot {slots[row, col]} but its position {pos[row, col]} "
                        f"lives at slot {expected[row, col]} of its block table",
                        "compute the slot mapping from the block table")


class PagedKVPool:
    """Page pools of every layer (zeroed, fixed size) and the step they are about to serve.

    As a cache of `OrtEngine.forward`: `feeds` gives the prepared step's positions, `bind` binds
    each pool as both its past input and its present output (the graph writes in place) plus the
    int32 step inputs, `advance` ends the step."""

    def __init__(self, past: list[str], present: list[str], num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype, device: str = "cpu", device_id: int = 0):
        if device not in ("cpu", "cuda"):
            raise UserError(f"the paged KV pool runs on cpu or cuda, not {device!r}", "use --device cpu or cuda")
        if num_pages < 2:
            raise UserError(f"a paged KV pool needs at least 2 pages, got {num_pages}", "give more pages")
        self.past, self.present = list(past), list(present)
        self.num_pages, self.page_size = num_pages, page_size
        self.device = device
        self.dtype = np.dtype(dtype)
        self.shape = (num_pages, page_size, kv_heads, head_dim)
        # On the CPU the OrtValues share the numpy arrays' memory; on CUDA they own device memory
        # (zeroed from a host array once) and `arrays` is None.
        zeros = [np.zeros(self.shape, self.dtype) for _ in self.past]
        self.values = [ort.OrtValue.ortvalue_from_numpy(a, device, device_id) for a in zeros]
        self.arrays = zeros if device == "cpu" else None
        self.step: PagedStep | None = None

    @classmethod
    def for_session(cls, session: ort.InferenceSession, num_pages: int, device: str = "cpu") -> "PagedKVPool":
        inputs = {i.name: i for i in session.get_inputs()}
        outputs = {o.name for o in session.get_outputs()}
        if not set(METADATA) <= set(inputs):
            raise UserError("this graph has no paged KV layout (block_tables, context_lens, slot_mapping)",
                            "rebuild the engine with the kv_paged pass")
        past = [n for n in inputs if n.startswith("past_key_values.")]
        present = [n.replace("past_key_values.", "present.") for n in past]
        missing = [n for n in present if n not in outputs]
        if missing:
            raise UserError(f"the paged graph lacks outputs {missing[:2]}", "rebuild the engine")
        first = inputs[past[0]]
        page_size, kv_heads, head_dim = (int(d) for d in first.shape[1:])
        return cls(past, present, num_pages, page_size, kv_heads, head_dim, _NP[first.type], device)

    def nbytes(self) -> int:
        return len(self.values) * int(np.prod(self.shape)) * self.dtype.itemsize

    def host_arrays(self) -> list[np.ndarray]:
        """Every layer's pool as numpy arrays (the live memory on the CPU, a copy from the device on CUDA)."""
        return self.arrays if self.arrays is not None else [v.numpy() for v in self.values]

    def prepare(self, step: PagedStep) -> None:
        check_step(step, self.num_pages, self.page_size)
        self.step = step

    def copy_pages(self, copies) -> None:
        """Copy-on-write: page dst takes page src's contents in every layer's pool. On CUDA each
        pool makes a round trip through the host (ORT's Python API has no device-side slice copy):
        correct, and O(pool) per fork; forks are rare next to decode steps."""
        copies = list(copies)
        if not copies:
            return
        if self.arrays is not None:
            for src, dst in copies:
                for a in self.arrays:
                    a[dst] = a[src]
            return
        for value in self.values:
            a = value.numpy()
            for src, dst in copies:
                a[dst] = a[src]
            value.update_inplace(a)

    # ------------------------------------------------------------ the engine's cache protocol

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        assert self.step is not None, "prepare() the step before running it"
        return {"position_ids": self.step.position_ids}

    def bind(self, binding: ort.IOBinding, device: str, device_id: int = 0) -> None:
        assert self.step is not None, "prepare() the step before running it"
        for past, present, value in zip(self.past, self.present, self.values):
            binding.bind_ortvalue_input(past, value)
            binding.bind_ortvalue_output(present, value)
        for name in METADATA:
            binding.bind_cpu_input(name, np.ascontiguousarray(getattr(self.step, name), dtype=np.int32))

    def advance(self, presents) -> None:
        self.step = None


def build_step(manager: KVCacheManager, rows: list[str], starts: list[int], counts: list[int], width: int,
               right_padded: bool = True) -> PagedStep:
    """The step of `rows` (request ids with slots already allocated): row r writes counts[r] tokens
    from position starts[r], in `width` columns, padded on the right (or on the left)."""
    batch, bs = len(rows), manager.block_size
    slots = np.full((batch, width), -1, np.int32)
    positions = np.zeros((batch, width), np.int64)
    ctx = np.zeros(batch, np.int32)
    for r, (rid, start, n) in enumerate(zip(rows, starts, counts)):
        cols = slice(0, n) if right_padded else slice(width - n, width)
        slots[r, cols] = manager.slots(rid, start, n)
        positions[r, cols] = np.arange(start, start + n)
        ctx[r] = start + (width if right_padded else n)
    pages = max(1, int(-(-ctx.max() // bs)))
    tables = np.zeros((batch, pages), np.int32)  # 0: the null page
    for r, rid in enumerate(rows):
        ids = manager.block_ids(rid)[:pages]
        tables[r, :len(ids)] = ids
    return PagedStep(tables, ctx, slots, positions)


class PagedKVCache:
    """A paged cache behind the dense-cache interface of `OrtEngine.forward` / `generate_ids`:
    each row of a left-padded batch is one request of a KVCacheManager over a PagedKVPool."""

    def __init__(self, pool: PagedKVPool, batch: int, enable_caching: bool = False):
        self.pool = pool
        self.manager = KVCacheManager(pool.num_pages, pool.page_size, enable_caching)
        self.rows = [f"row{r}" for r in range(batch)]
        self.pads = np.zeros(batch, np.int64)  # left padding of each row's first step (dense length)

    @classmethod
    def for_session(cls, session, batch: int, device: str = "cpu", num_pages: int | None = None,
                    max_tokens: int = 2048) -> "PagedKVCache":
        """num_pages defaults to enough for `max_tokens` per row, plus the null page."""
        inputs = {i.name: i for i in session.get_inputs()}
        page_size = int(next(i for n, i in inputs.items() if n.startswith("past_key_values.")).shape[1])
        pages = num_pages or 1 + batch * -(-max_tokens // page_size)
        return cls(PagedKVPool.for_session(session, pages, device), batch)

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        """Positions of the longest row, left padding included (as the dense cache counts them)."""
        return int(max(self.manager.num_tokens(r) + p for r, p in zip(self.rows, self.pads)))

    def feeds(self, attention_mask: np.ndarray, position_ids: np.ndarray) -> dict[str, np.ndarray]:
        """Allocate slots for the real tokens among the last S mask columns and prepare the step."""
        batch, width = position_ids.shape
        if batch != self.batch:
            raise UserError(f"a batch of {batch} rows was fed to a cache made for {self.batch}",
                            "make the cache for this batch size")
        real = np.asarray(attention_mask)[:, -width:].astype(bool)
        if np.any(real[:, :-1] & ~real[:, 1:]):
            raise UserError("padding after a real token in a paged-cache step", "left-pad the prompts")
        counts = real.sum(axis=1).astype(int)
        starts = [self.manager.num_tokens(r) for r in self.rows]
        if any(s > 0 and n < width for s, n in zip(starts, counts)):
            raise UserError("padding fed to a row that already holds tokens", "pad only a row's first chunk")
        for r, (rid, n) in enumerate(zip(self.rows, counts)):
            if starts[r] == 0:
                self.pads[r] = width - n
            if self.manager.allocate_slots(rid, int(n)) is None:
                raise UserError(f"the paged KV pool ({self.pool.num_pages} pages of {self.pool.page_size}) is "
                                "full", "make the cache with more pages (num_pages / max_tokens)")
        self.pool.prepare(build_step(self.manager, self.rows, starts, list(counts), width, right_padded=False))
        return self.pool.feeds(attention_mask, position_ids)

    def bind(self, binding, device: str, device_id: int = 0) -> None:
        self.pool.bind(binding, device, device_id)

    def advance(self, presents) -> None:
        self.pool.advance(presents)

    def truncate(self, length: int) -> None:
        """Drop positions >= length of the padded layout (speculative decoding rollback)."""
        for rid, pad in zip(self.rows, self.pads):
            self.manager.truncate(rid, max(int(length - pad), 0))

    def select(self, rows: np.ndarray) -> None:
        """Keep only batch rows `rows`; the others' pages go back to the pool."""
        keep = [int(r) for r in np.asarray(rows)]
        for r, rid in enumerate(self.rows):
            if r not in keep:
                self.manager.free(rid)
        self.rows = [self.rows[r] for r in keep]
        self.pads = self.pads[keep].copy()
