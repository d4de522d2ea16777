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

Padding: rows of a step may hold fewer real tokens than S. Right padding (runtime.decoding.batching) keeps
`context_lens = computed + S`, so every query column has a valid position and no pad is ever
attended by a real token; the TensorRT plugin requires that (context_lens >= S). Left padding (what
`generate_ids` feeds) sets `context_lens = computed + real`, so pad columns get positions < 0 and
attend to nothing: fine for the ONNX Runtime lowerings, not for the plugin.

Page 0 is the null page: block tables are padded with it, nothing owns it (block_manager reserves
it), so reads past a row's tokens stay in bounds. Pools start zeroed (garbage could be NaN).
"""

from __future__ import annotations


import numpy as np

from enginesmith.core.kv_layout import PagedStep, check_step, paged_step  # noqa: F401  (re-exported)
from enginesmith.core import io_names
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.runtime.kv.block_manager import KVCacheManager

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
METADATA = io_names.PAGED_INPUTS  # block_tables, context_lens, slot_mapping


class PagedKVPool:
    """Page pools of every layer (zeroed, fixed size) and the step they are about to serve.

    As a cache of `OrtEngine.forward`: `feeds` gives the prepared step's positions, `bind` binds
    each pool as both its past input and its present output (the graph writes in place) plus the
    int32 step inputs, `advance` ends the step."""

    max_chunk = None  # protocols.OrtCache: any number of tokens per call

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
        past = [n for n in inputs if io_names.is_past(n)]
        present = [io_names.present_of(n) for n in past]
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
    return paged_step([manager.block_ids(r) for r in rows], manager.block_size, starts, counts, width, right_padded)


class PagedKVCache:
    """A paged cache behind the dense-cache interface of `OrtEngine.forward` / `generate_ids`:
    each row of a left-padded batch is one request of a KVCacheManager over a PagedKVPool."""

    rollback = True   # pages past the kept positions go back to the pool
    evicts = False
    max_chunk = None

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
        page_size = int(next(i for n, i in inputs.items() if io_names.is_past(n)).shape[1])
        pages = num_pages or 1 + batch * -(-max_tokens // page_size)
        return cls(PagedKVPool.for_session(session, pages, device), batch)

    @property
    def batch(self) -> int:
        return len(self.rows)

    @property
    def length(self) -> int:
        """Positions of the longest row, left padding included (as the dense cache counts them)."""
        return int(max(self.manager.num_tokens(r) + p for r, p in zip(self.rows, self.pads)))

    def nbytes(self) -> int:
        """Bytes of the page pools (fixed at construction, shared by every row)."""
        return self.pool.nbytes()

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
