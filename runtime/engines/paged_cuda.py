"""The CUDA paged engine: many requests at once over one pool of KV pages (in-flight batching).

Runs a graph lowered by passes/lower/ort_paged_gqa.py (`build --for-cuda --kv paged`): every layer's
attention is enginesmith's PagedGroupQueryAttention ORT op (rotary, the KV write through the slot
mapping and paged attention in one op), the linear layers enginesmith's GEMV ops (cuBLAS from
plugins/ort_ops kCublasMinRows rows on). It is the `PagedModel` of runtime.decoding.batching: the
ContinuousBatcher schedules, this engine runs steps and samples.

Dimension legend: L layers, NB pages, BS page size, Hkv, D head size, B rows of a step, S columns,
MB block-table width (= ceil(capacity / BS)), V vocab.

Memory:
    kv  [L, 2, NB, BS, Hkv, D]  one device tensor; layer i's pools kv[i, 0] / kv[i, 1] are bound as
                                both past_key_values.i.* and present.i.* (the op writes in place); of
                                the graph's pool type: fp16, or int8 / uint8 (fp8 e4m3) codes of a
                                `build --kv-dtype int8|fp8` engine (half the bytes: twice the pages;
                                the scales are constants in the graph)
    NB  from free GPU memory after a warm-up at the largest step shape (weights and ORT's activation
        arena are then resident): (total * gpu_memory_utilization - used) / bytes per page

A step:
    decode only (S = 1)    the rows are padded to a batch bucket (1, 2, 4, ... max_batch); each bucket
                           has fixed buffers bound once and is captured as a CUDA graph after warm-up
                           runs, then replayed (padding rows: null page, context 1, slot -1)
    with prompt chunks     a plain run over fresh buffers [B, S] (S <= the op's max query length)
    sampling               on the device: the picked rows' logits; greedy is an argmax per row;
                           sampled rows draw with a generator seeded by (request seed, token index),
                           so a request's tokens do not depend on its batch-mates; only the token ids
                           [P] come back to the host
    launch / run           `launch` queues all of the above (host inputs through pinned staging, the
                           token ids into pinned memory, an event after them) and returns at once;
                           `result()` waits for the event. `run` = launch + result. The scheduler's
                           async steps use `launch`: its host work for the next step runs meanwhile
On the CPU (tests, CI) the same graph runs through the ops' CPU kernels, with no graphs.

Sliding windows: when every layer's op has a local_window_size (Mistral-style), `kv_window` is the
largest and the scheduler's block manager gives back the pages behind it (runtime/kv/block_manager.py);
one global layer (Gemma 2/3 alternate them) needs every page of the one shared table: None.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from enginesmith.core import engine_dir, io_names
from enginesmith.core.errors import UserError
from enginesmith.core.kv_layout import PagedStep, check_step
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.plugins.limits import limits as kernel_limits
from enginesmith.runtime.engines.ort_cuda import (CAPACITY_KEY, _bind, _torch, cuda_session, device_argmax,
                                                  run_captured, sample_on_device)
from enginesmith.runtime.protocols import LoadedEngine
from enginesmith.runtime.text.tokenizer import Tokenizer

SLACK_BYTES = 512 << 20   # kept free beyond the utilization share: cuBLAS workspaces, graph pools, sampling
CPU_PAGES = 1024          # default pool on the CPU


@dataclass
class _Bucket:
    """Fixed buffers and binding of decode steps of `rows` rows; a CUDA graph once captured."""

    rows: int
    ids: object            # torch int64 [rows, 1]
    tables: object         # torch int32 [rows, MB]
    context: object        # torch int32 [rows]
    slots: object          # torch int32 [rows, 1]
    logits: object         # torch [rows, 1, V]
    binding: ort.IOBinding
    runs: int = 0
    graph: object = None
    host: dict = field(default_factory=dict)  # pinned staging copies of the inputs
    staged: object = None  # CUDA event after the staging copies: `host` may be rewritten once it is done


class _Pending:
    """Token ids [P] of a launched step: on their way to pinned host memory (CUDA) or already there."""

    def __init__(self, tokens, done=None):
        self.tokens, self.done = tokens, done

    def result(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.tokens.tolist()


def _pow2_buckets(max_batch: int) -> list[int]:
    buckets, b = [], 1
    while b < max_batch:
        buckets.append(b)
        b *= 2
    return buckets + [max_batch]


def noise_seed(seed: int, index: int) -> int:
    """The generator seed of token `index` of a request seeded `seed` (63 bits, stable across runs)."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class PagedCudaEngine:
    """A PagedModel (runtime.decoding.batching) over a paged-GQA graph: `run(ids, step, picks)` per step."""

    is_paged_model = True
    WARMUP_RUNS = 2

    def __init__(self, onnx_path: str | Path, device: str = "auto", max_batch: int = 64,
                 num_pages: int | None = None, gpu_memory_utilization: float = 0.9,
                 capacity: int | None = None, cuda_graph: bool | str = True, threads: int | None = None,
                 device_id: int = 0, weight_bytes: int = 0) -> None:
        torch = _torch()
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise UserError(f"--gpu-memory-utilization {gpu_memory_utilization} is outside (0, 1]",
                            "give the share of the GPU's memory this engine may use, e.g. 0.9")
        if not isinstance(max_batch, int) or max_batch < 1:
            raise UserError(f"max_batch {max_batch!r} must be a positive integer", "e.g. 64")
        cs = cuda_session(onnx_path, device, device_id, "torch" if cuda_graph is True else cuda_graph, threads)
        if cs.graph_mode == "ort":
            cs.graph_mode = "none"  # ORT's own capture cannot take per-step input copies: plain runs
        self.session, self.device, self.torch_device, self.stream = cs.session, cs.device, cs.torch_device, cs.stream
        self.graph_mode, self.shared_stream = cs.graph_mode, cs.shared_stream
        inputs = {i.name: i for i in self.session.get_inputs()}
        if not set(io_names.PAGED_INPUTS) <= set(inputs) or "seqlens_k" in inputs:
            raise UserError(f"{onnx_path} is not a paged-GQA graph (no {io_names.BLOCK_TABLES} input)",
                            "build the engine with --for-cuda --kv paged")
        self.past_names = [n for n in inputs if io_names.is_past(n)]
        self.present_names = [io_names.present_of(n) for n in self.past_names]
        first = inputs[self.past_names[0]]
        self.page_size, self.kv_heads, self.head_dim = (int(d) for d in first.shape[1:])
        self.vocab = int(self.session.get_outputs()[0].shape[-1])
        meta = self.session.get_modelmeta().custom_metadata_map
        limit = int(meta.get(CAPACITY_KEY, 0)) or None
        if limit is None:
            raise UserError(f"{onnx_path} does not record its KV capacity ({CAPACITY_KEY})", "rebuild the engine")
        self.max_positions = min(capacity or limit, limit)
        self.max_blocks = -(-limit // self.page_size)  # the graph's rotary tables bound the table width
        self.max_chunk = int(kernel_limits()["paged_attention"]["max_query_len"])
        self.layer_windows = layer_windows(onnx_path)
        windowed = bool(self.layer_windows) and None not in self.layer_windows
        self.kv_window = max(self.layer_windows) if windowed else None  # type: ignore[type-var]
        self.max_batch = max_batch
        # the ORT ops read ES_BATCH_INVARIANT once per process; the scheduler then groups rows by width
        self.batch_invariant = os.environ.get("ES_BATCH_INVARIANT") == "1"
        self.dtype = {"tensor(float16)": torch.float16, "tensor(int8)": torch.int8,
                      "tensor(uint8)": torch.uint8}.get(first.type, torch.float32)  # the pools' element
        logits_type = self.session.get_outputs()[0].type
        self.logits_dtype = torch.float16 if "float16" in logits_type else torch.float32
        self.layers = len(self.past_names) // 2
        item = torch.empty((), dtype=self.dtype).element_size()
        self.kv_bytes_per_token = 2 * self.layers * self.kv_heads * self.head_dim * item
        self.page_bytes = self.kv_bytes_per_token * self.page_size
        self.weight_bytes = weight_bytes
        self.buckets = _pow2_buckets(max_batch)
        self._buckets: dict[int, _Bucket] = {}
        # The scheduler prepares step n+1 while step n runs (launch returns at once on CUDA; on the CPU
        # launch computes the step). On by default on CUDA: on an H200 (session 18) it made the batch-64
        # step 1.31x faster (2.10 vs 2.75 ms) and `bench --requests 64` 1.20x, and the GPU identity and
        # page-leak tests pass with it. ES_ASYNC_STEPS=0, or SchedulerConfig(async_steps=False), turns it off.
        self.launch_returns_early = self.device == "cuda"
        self.async_steps = self.launch_returns_early and os.environ.get("ES_ASYNC_STEPS", "1") != "0"
        if num_pages is None:
            num_pages = self._pages_from_memory(gpu_memory_utilization) if self.device == "cuda" else CPU_PAGES
        if num_pages < 2:
            raise UserError(f"the KV pool would have {num_pages} pages; it needs at least 2",
                            "raise --gpu-memory-utilization or free GPU memory")
        self.num_pages = int(num_pages)
        with self._on_stream():
            self.kv = torch.zeros(self.layers, 2, self.num_pages, self.page_size, self.kv_heads, self.head_dim,
                                  dtype=self.dtype, device=self.torch_device)

    # ------------------------------------------------------------------ plumbing
    def _on_stream(self):
        return _torch().cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _binding(self, kv, ids, tables, context, slots, logits) -> ort.IOBinding:
        binding = self.session.io_binding()
        _bind(binding, "input_ids", ids)
        _bind(binding, io_names.BLOCK_TABLES, tables)
        _bind(binding, io_names.CONTEXT_LENS, context)
        _bind(binding, io_names.SLOT_MAPPING, slots)
        for i, (past, present) in enumerate(zip(self.past_names, self.present_names)):
            layer, kind = divmod(i, 2)
            _bind(binding, past, kv[layer, kind])
            _bind(binding, present, kv[layer, kind], output=True)  # the same memory: written in place
        _bind(binding, "logits", logits, output=True)
        return binding

    def _run(self, binding: ort.IOBinding, options: ort.RunOptions | None = None) -> None:
        if self.stream is not None and not self.shared_stream:
            self.stream.synchronize()  # torch's writes to the bound inputs must land first
        self.session.run_with_iobinding(binding, options or self._options)

    @property
    def _options(self) -> ort.RunOptions:
        options = ort.RunOptions()
        if self.graph_mode == "torch":  # no stream sync at the end of Run: it may be captured
            options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        return options

    def _to_device(self, values, dtype):
        """A host array (or list) on the device without a host sync: through pinned memory on CUDA (a
        pageable copy waits for the stream, i.e. for the step queued before it)."""
        torch = _torch()
        t = torch.from_numpy(np.ascontiguousarray(values, dtype))
        if self.device != "cuda":
            return t
        return t.pin_memory().to(self.torch_device, non_blocking=True)

    def _plain(self, kv, ids: np.ndarray, tables: np.ndarray, context: np.ndarray, slots: np.ndarray):
        """One step without a CUDA graph: logits [rows, cols, V]. Safe from any stream: the input copies and
        the run go on the engine's stream (ORT's, when shared), and the caller's stream waits for it before
        it reads the logits. (Called from torch's default stream, the copies went there while ORT ran on
        the engine's stream: under load a step read stale inputs and the caller stale logits.)"""
        torch = _torch()
        with self._on_stream():
            t_ids = self._to_device(ids, np.int64)
            t_tables = self._to_device(tables, np.int32)
            t_ctx = self._to_device(context, np.int32)
            t_slots = self._to_device(slots, np.int32)
            logits = torch.empty(*ids.shape, self.vocab, dtype=self.logits_dtype, device=self.torch_device)
            self._run(self._binding(kv, t_ids, t_tables, t_ctx, t_slots, logits))
        if self.stream is not None:
            caller = torch.cuda.current_stream(self.torch_device)
            if caller != self.stream:
                caller.wait_stream(self.stream)
                logits.record_stream(caller)  # freed by the caller: not reused before its reads are done
        return logits

    def _pages_from_memory(self, utilization: float) -> int:
        """Pages that fit in the utilization share of the GPU once a step of the largest shape has run
        (weights and ORT's activation arena resident) over a two-page pool."""
        torch = _torch()
        rows, cols = self.max_batch, self.max_chunk
        with self._on_stream():
            kv = torch.zeros(self.layers, 2, 2, self.page_size, self.kv_heads, self.head_dim, dtype=self.dtype,
                             device=self.torch_device)
            tables = np.zeros((rows, self.max_blocks), np.int32)
            self._plain(kv, np.zeros((rows, cols), np.int64), tables, np.full(rows, cols, np.int32),
                        np.full((rows, cols), -1, np.int32))
            self.stream.synchronize()
            del kv
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.torch_device)
        budget = total * utilization - (total - free) - SLACK_BYTES - self._bucket_bytes()
        return int(budget // self.page_bytes)

    def _bucket_bytes(self) -> int:
        item = 2 if self.logits_dtype != _torch().float32 else 4
        return sum(b * (self.vocab * item + 4 * (self.max_blocks + 4)) for b in self.buckets)

    def _bucket(self, batch: int) -> _Bucket:
        rows = next(b for b in self.buckets if b >= batch)
        if rows not in self._buckets:
            torch = _torch()
            dev = self.torch_device
            with self._on_stream():
                ids = torch.zeros(rows, 1, dtype=torch.int64, device=dev)
                tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev)
                context = torch.ones(rows, dtype=torch.int32, device=dev)
                slots = torch.full((rows, 1), -1, dtype=torch.int32, device=dev)
                logits = torch.zeros(rows, 1, self.vocab, dtype=self.logits_dtype, device=dev)
            pinned = self.device == "cuda"
            host = {"ids": torch.zeros(rows, 1, dtype=torch.int64, pin_memory=pinned),
                    "tables": torch.zeros(rows, self.max_blocks, dtype=torch.int32, pin_memory=pinned),
                    "context": torch.ones(rows, dtype=torch.int32, pin_memory=pinned),
                    "slots": torch.full((rows, 1), -1, dtype=torch.int32, pin_memory=pinned)}
            binding = self._binding(self.kv, ids, tables, context, slots, logits)
            self._buckets[rows] = _Bucket(rows, ids, tables, context, slots, logits, binding, host=host)
        return self._buckets[rows]

    def _replay(self, bucket: _Bucket) -> None:
        run_captured(self, bucket, bucket.binding, self._options)

    def _decode(self, ids: np.ndarray, tables: np.ndarray, context: np.ndarray, slots: np.ndarray):
        """A decode-only step through its batch bucket: device logits [B, V]."""
        batch = ids.shape[0]
        bucket = self._bucket(batch)
        if bucket.staged is not None:  # the last copies out of the staging buffers must be done
            bucket.staged.synchronize()
        h = bucket.host
        h["ids"].zero_()
        h["tables"].zero_()
        h["context"].fill_(1)
        h["slots"].fill_(-1)
        h["ids"].numpy()[:batch] = ids
        h["tables"].numpy()[:batch, :tables.shape[1]] = tables
        h["context"].numpy()[:batch] = context
        h["slots"].numpy()[:batch] = slots
        cuda = self.device == "cuda"
        for name in ("ids", "tables", "context", "slots"):
            getattr(bucket, name).copy_(h[name], non_blocking=cuda)
        if cuda:  # the pinned staging buffers are rewritten next step, once these copies are done
            if bucket.staged is None:
                bucket.staged = _torch().cuda.Event()
            bucket.staged.record(self.stream)
        self._replay(bucket)
        return bucket.logits[:batch, 0]

    # ------------------------------------------------------------------ the PagedModel interface
    def copy_pages(self, copies: Sequence[tuple[int, int]]) -> None:
        copies = list(copies)
        if not copies:
            return
        with self._on_stream():  # queued before the step that reads the copies
            src = self._to_device([s for s, _ in copies], np.int64)
            dst = self._to_device([d for _, d in copies], np.int64)
            self.kv[:, :, dst] = self.kv[:, :, src]

    def run(self, ids: np.ndarray, step: PagedStep, picks) -> list[int]:
        return self.launch(ids, step, picks).result()

    def launch(self, ids: np.ndarray, step: PagedStep, picks) -> _Pending:
        """Queue the step (forward and sampling) on the engine's stream; `.result()` gives the token ids."""
        batch, width = ids.shape
        if batch > self.max_batch:
            raise UserError(f"a step of {batch} rows exceeds this engine's max_batch {self.max_batch}",
                            f"schedule at most {self.max_batch} rows")
        if width > self.max_chunk:
            raise UserError(f"a step of {width} tokens per row exceeds the attention op's {self.max_chunk}",
                            f"use a scheduler chunk <= {self.max_chunk}")
        check_step(step, self.num_pages, self.page_size)
        if int(step.context_lens.max()) > self.max_blocks * self.page_size:
            raise UserError(f"a row reaches position {int(step.context_lens.max())}, beyond the engine's "
                            f"{self.max_blocks * self.page_size}", "use shorter requests")
        torch = _torch()
        rows = [p.row for p in picks]
        with self._on_stream():
            if width == 1 and self.graph_mode == "torch":
                logits = self._decode(ids, step.block_tables, step.context_lens, step.slot_mapping)
                in_order = rows == list(range(len(rows)))  # every decode row samples: a view, no index copy
                chosen = logits[:len(rows)] if in_order else logits[self._to_device(rows, np.int64)]
            else:
                tables = np.zeros((batch, self.max_blocks), np.int32)
                tables[:, :step.block_tables.shape[1]] = step.block_tables
                logits = self._plain(self.kv, ids, tables, step.context_lens, step.slot_mapping)
                index = self._to_device([rows, [p.col for p in picks]], np.int64)
                chosen = logits[index[0], index[1]]
            if not picks:
                return _Pending(torch.empty(0, dtype=torch.int64))
            tokens = self._sample(chosen, picks)
            if self.device != "cuda":
                return _Pending(tokens)
            host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
            return _Pending(host, done)

    def _sample(self, logits, picks):
        """Token ids [P] (torch, on the device) for the picked rows' logits [P, V]."""
        torch = _torch()
        plain = [i for i, p in enumerate(picks) if p.sampling.greedy and p.history is None]
        if len(plain) == len(picks):
            return device_argmax(logits)
        out = torch.empty(len(picks), dtype=torch.int64, device=logits.device)
        if plain:
            index = self._to_device(plain, np.int64)
            out[index] = device_argmax(logits[index])
        for i, pick in enumerate(picks):
            if i in plain:
                continue
            seen = None
            if pick.history is not None:
                seen = torch.zeros(1, logits.shape[-1], dtype=torch.bool, device=logits.device)
                seen[0, self._to_device(list(pick.history), np.int64)] = True
            generator = torch.Generator(logits.device)
            generator.manual_seed(noise_seed(pick.seed, pick.index))
            out[i] = sample_on_device(logits[i:i + 1], pick.sampling, generator, seen)[0]
        return out

    def nbytes(self) -> int:
        return int(self.kv.numel() * self.kv.element_size())


def layer_windows(onnx_path: str | Path) -> list[int | None]:
    """Each paged attention op's sliding window (local_window_size > 0), or None (a global layer), in
    graph order; the graph alone is read (its weights stay in their external data)."""
    model = onnx.load(str(onnx_path), load_external_data=False)
    out: list[int | None] = []
    for node in model.graph.node:
        if node.op_type == "PagedGroupQueryAttention":
            size = next((a.i for a in node.attribute if a.name == "local_window_size"), -1)
            out.append(int(size) if size > 0 else None)
    return out


def open_paged_engine(path: str | Path, device: str = "auto", max_batch: int | None = None,
                      num_pages: int | None = None, gpu_memory_utilization: float = 0.9,
                      threads: int | None = None, verify_hashes: bool = True) -> LoadedEngine:
    """The paged-GQA branch of runtime.load.open_engine: a LoadedEngine whose engine is a
    PagedCudaEngine (build.json kv_layout.io == io_names.PAGED_GQA_IO). max_batch defaults to the
    build's --max-batch; more than it is refused."""
    path = Path(path)
    manifest = engine_dir.verify(path, hashes=verify_hashes, onnx_graph=True)
    built = manifest.kv_layout.max_batch
    if max_batch is not None and built is not None and max_batch > built:
        raise UserError(f"{max_batch} rows per step exceed the --max-batch {built} this engine was built with",
                        f"rebuild it with --max-batch {max_batch} or more")
    weights = sum(record.size for rel, record in manifest.files.items() if rel.startswith(manifest.graph))
    engine = PagedCudaEngine(path / manifest.graph, device=device, max_batch=max_batch or built or 64,
                             num_pages=num_pages, gpu_memory_utilization=gpu_memory_utilization,
                             capacity=manifest.kv_layout.capacity, threads=threads, weight_bytes=weights)
    return LoadedEngine(path, manifest, engine, Tokenizer(path / "tokenizer"))
