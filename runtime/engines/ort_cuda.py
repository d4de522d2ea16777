"""The fast ONNX Runtime path for graphs lowered by passes/lower_gqa.py (GroupQueryAttention over a
shared KV buffer): one KV allocation, IOBinding with fixed addresses, CUDA graphs for decode and
verify steps, sampling on the device. Runs on CPU too (no graphs), which is how it is tested here.

Dimension legend: L layers, B batch (rows of the buffer), C KV capacity, Hkv, D head size, S tokens
per call, V vocab.

Memory: `kv` [L, 2, B, Hkv, C, D] is one device tensor. Layer i's keys kv[i, 0] are bound as both
`past_key_values.i.key` and `present.i.key`; GQA writes the new tokens in place. Its element is the
graph's KV type: fp16 (or fp32 on the CPU), or int8 / uint8 (fp8 e4m3) codes of a `build --for-cuda
--custom-attention --kv-dtype int8|fp8` engine (passes/lower/ort_kv_quant.py; the op holds the scales),
one byte an element: half of fp16's, so the memory of B rows at capacity C holds 2B rows, or rows of 2C
positions (SmolLM2: 30 layers x 2 x 3 KV heads x 64 = 11,520 elements a token, 22.5 KiB in fp16,
11.25 KiB in int8/fp8; Llama-3.2-1B: 32 KiB vs 16 KiB). Row b holds
lengths[b] tokens in slots 0..lengths[b]-1 (no holes: prompts are not padded, they are prefilled
row by row into their row's slice), so rollback (`truncate`) only lowers lengths.

    prefill          per row: batch-1 binding on kv[:, :, b], S = prompt length, no graph
    step (B, S)      fixed buffers ids [B, S], seqlens [B], logits [B, S, V] bound once; on CUDA
                     captured as a CUDA graph after warm-up runs and replayed
    sample           torch on the same stream: argmax, or argmax(probs / Exp(1) noise) (gpt-fast);
                     only the sampled ids [B] cross to the host

CUDA graphs, two ways (`cuda_graph=`):
    "torch" (default)  torch.cuda.graph captures ORT's Run (its kernels go to our stream through
                       user_compute_stream; run option disable_synchronize_execution_providers) and,
                       for greedy decode, the argmax into the ids buffer and seqlens += 1: one replay
                       per token, no host sync inside; the host reads token n while step n+1 runs.
    "ort"              ORT's own capture (enable_cuda_graph, gpu_graph_id per shape); ORT syncs the
                       stream after every replay (cuda_graph.cc), so host work between steps is exposed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from enginesmith.core import engine_dir, io_names
from enginesmith.core.io_names import MAX_CUDA_BATCH
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.plugins import ort_ops
from enginesmith.runtime.decoding.generate import check_budget
from enginesmith.runtime.protocols import LoadedEngine
from enginesmith.runtime.text.tokenizer import Tokenizer

SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"
CAPACITY_KEY = "enginesmith.kv_capacity"
MAX_GRAPH_SEQ = 16  # calls of up to this many tokens per row go through fixed (graph-captured) steps


def _torch():
    import torch

    return torch


def _np_dtype(tensor) -> type:
    torch = _torch()
    return {torch.float16: np.float16, torch.float32: np.float32, torch.bfloat16: np.float16,
            torch.int64: np.int64, torch.int32: np.int32, torch.int8: np.int8, torch.uint8: np.uint8}[tensor.dtype]


def _bind(binding: ort.IOBinding, name: str, tensor, output: bool = False) -> None:
    """Bind a contiguous torch tensor's memory (CPU or CUDA) by address."""
    assert tensor.is_contiguous(), name
    args = (name, tensor.device.type, tensor.device.index or 0, _np_dtype(tensor), list(tensor.shape),
            tensor.data_ptr())
    (binding.bind_output if output else binding.bind_input)(*args)


@dataclass
class CudaSession:
    """An ONNX Runtime session set up for device-resident decode loops (see the module docstring)."""

    session: ort.InferenceSession
    device: str            # "cuda" | "cpu"
    torch_device: object
    stream: object         # torch.cuda.Stream ORT runs on (None on the CPU)
    graph_mode: str        # "torch" | "ort" | "none"
    shared_stream: bool    # ORT and torch enqueue on one stream: no syncs between


def cuda_session(onnx_path: str | Path, device: str = "auto", device_id: int = 0, cuda_graph: bool | str = True,
                 threads: int | None = None, optimization: str = "all",
                 provider_options: dict | None = None) -> CudaSession:
    """The session of GqaEngine and paged_cuda.PagedCudaEngine: CUDA EP on a torch stream of ours (so
    torch can capture ORT's kernels into a CUDA graph), enginesmith's ORT ops registered when the graph
    uses them; on the CPU a plain session (no graphs)."""
    torch = _torch()
    available = ort.get_available_providers()
    if device == "auto":
        device = "cuda" if "CUDAExecutionProvider" in available and torch.cuda.is_available() else "cpu"
    if device == "cuda" and ("CUDAExecutionProvider" not in available or not torch.cuda.is_available()):
        raise UserError("this engine needs onnxruntime-gpu and a CUDA device on --device cuda", "use --device cpu")
    torch_device = torch.device("cuda", device_id) if device == "cuda" else torch.device("cpu")
    mode = {True: "torch", False: "none"}.get(cuda_graph, cuda_graph)
    if mode not in ("torch", "ort", "none"):
        raise UserError(f"unknown cuda_graph mode {cuda_graph!r}", "use torch, ort or none")
    graph_mode = mode if device == "cuda" else "none"
    opts = ort.SessionOptions()
    opts.graph_optimization_level = {"all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
                                     "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC}[optimization]
    opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    providers: list = ["CPUExecutionProvider"]
    stream = None
    if device == "cuda":
        # GQA decode: ORT 1.31 picks its XQA kernel by default; flash decoding was faster on an
        # H200 (Llama-3.2-1B shape, batch 1, ~256 positions: 846 vs 811 tok/s, one session,
        # benchmarks/gpu/profile_decode.py). ORT reads this when the session is built; a value the
        # user set wins.
        os.environ.setdefault("ORT_ENABLE_XQA", "0")
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        stream = torch.cuda.Stream(torch_device)  # capture needs a non-default stream
        providers = [("CUDAExecutionProvider", {
            "device_id": device_id, "enable_cuda_graph": "1" if graph_mode == "ort" else "0",
            "user_compute_stream": str(stream.cuda_stream)} | dict(provider_options or {}))]
    shared_stream = device == "cuda"
    ort_ops.register_for(opts, onnx_path)  # graphs rewritten by passes/ort_gemv.py, ort_attention.py
    try:
        session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
    except ort.capi.onnxruntime_pybind11_state.Fail:
        if device != "cuda":
            raise
        del providers[0][1]["user_compute_stream"]  # ORT's own stream; sync before each run
        shared_stream = False
        if graph_mode == "torch":  # capturing ORT's kernels needs them on our stream
            graph_mode = "ort"
            providers[0][1]["enable_cuda_graph"] = "1"
        session = ort.InferenceSession(str(onnx_path), opts, providers=providers)
    return CudaSession(session, device, torch_device, stream, graph_mode, shared_stream)


class SharedKVCache:
    """Rows 0..B-1 of the engine's KV buffer; `lengths[b]` tokens cached in row b."""

    rollback = True   # rows just get shorter
    evicts = False

    def __init__(self, engine: "GqaEngine", batch: int):
        self.engine = engine
        self.lengths = np.zeros(batch, dtype=np.int64)

    @property
    def batch(self) -> int:
        return len(self.lengths)

    @property
    def length(self) -> int:
        return int(self.lengths.max())

    def truncate(self, length: int) -> None:
        """Drop positions >= length (speculative rollback): nothing moves, rows just get shorter."""
        np.minimum(self.lengths, length, out=self.lengths)

    def nbytes(self) -> int:
        """Bytes of this cache's rows of the engine's buffer (allocated once, at full capacity)."""
        rows = self.engine.kv[:, :, :self.batch]
        return int(rows.numel() * rows.element_size())


@dataclass
class _Step:
    """Buffers and binding for calls of shape [B, S] over rows 0..B-1, captured as one CUDA graph."""

    ids: object        # torch int64 [B, S]
    seqlens: object    # torch int32 [B]
    logits: object     # torch [B, S, V]
    binding: ort.IOBinding
    run_options: ort.RunOptions
    runs: int = 0
    graph: object = None   # torch.cuda.CUDAGraph once captured ("torch" mode)
    slots: object = None   # greedy decode: pinned host copies of the ids, and their events
    events: list = field(default_factory=list)


def run_captured(engine, step, binding: ort.IOBinding, options: ort.RunOptions, tail=None) -> None:
    """Run a fixed step of `engine` (GqaEngine, paged_cuda.PagedCudaEngine): WARMUP_RUNS plain runs
    first (ORT's arena must hold all it needs), then ("torch" graph mode) a CUDA graph captured once
    and replayed from then on. `tail()` (torch ops after the model, e.g. the greedy argmax) is part of
    the step. `step` keeps `runs` and `graph`."""
    if engine.graph_mode != "torch" or step.runs < engine.WARMUP_RUNS:
        engine._run(binding, options)
        if tail is not None:
            tail()
    else:
        if step.graph is None:
            torch = _torch()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=engine.stream, capture_error_mode="thread_local"):
                engine.session.run_with_iobinding(binding, options)
                if tail is not None:
                    tail()
            step.graph = graph  # capturing ran nothing: the replay below runs this step
        step.graph.replay()
    step.runs += 1


class GqaEngine:
    """forward(ids, mask, positions, cache) -> logits (the Engine interface of generate/speculative)
    plus the device paths used by `fast_generate_ids` and `greedy_forward`."""

    WARMUP_RUNS = 2  # plain runs of a step before capture (ORT's arena must hold all it needs)
    device_decode = True  # greedy_forward and fast_generate_ids: logits stay on the device

    def __init__(self, onnx_path: str | Path, device: str = "auto", max_batch: int = 1,
                 capacity: int | None = None, cuda_graph: bool | str = True, threads: int | None = None,
                 device_id: int = 0, optimization: str = "all", provider_options: dict | None = None) -> None:
        torch = _torch()
        cs = cuda_session(onnx_path, device, device_id, cuda_graph, threads, optimization, provider_options)
        self.session, self.device, self.torch_device, self.stream = cs.session, cs.device, cs.torch_device, cs.stream
        self.graph_mode, self.shared_stream = cs.graph_mode, cs.shared_stream
        self.cuda_graph = self.graph_mode != "none"
        inputs = {i.name: i for i in self.session.get_inputs()}
        if SEQLENS not in inputs or TOTAL not in inputs:
            raise UserError(f"{onnx_path} is not a GQA-lowered graph (no {SEQLENS} input)",
                            "lower it with the lower_gqa pass, or open it with OrtEngine")
        self.past_names = [n for n in inputs if io_names.is_past(n)]
        self.present_names = [io_names.present_of(n) for n in self.past_names]
        first = inputs[self.past_names[0]]
        self.kv_heads, self.head_dim = int(first.shape[1]), int(first.shape[3])
        self.vocab = int(self.session.get_outputs()[0].shape[-1])
        meta = self.session.get_modelmeta().custom_metadata_map
        limit = int(meta.get(CAPACITY_KEY, 0)) or None
        self.capacity = capacity or limit or 4096
        if limit and self.capacity > limit:
            raise UserError(f"KV capacity {self.capacity} exceeds the {limit} positions the graph's rotary "
                            "tables cover", f"use a capacity <= {limit}")
        self.max_batch = max_batch
        codes = {"tensor(int8)": torch.int8, "tensor(uint8)": torch.uint8}  # quantized KV: the buffers' element
        self.dtype = codes.get(first.type, torch.float16 if "float16" in first.type else torch.float32)
        logits_type = self.session.get_outputs()[0].type
        self.logits_dtype = torch.float16 if "float16" in logits_type else torch.float32
        layers = len(self.past_names) // 2
        with self._on_stream():
            self.kv = torch.zeros(layers, 2, max_batch, self.kv_heads, self.capacity, self.head_dim,
                                  dtype=self.dtype, device=self.torch_device)
        self.kv_bytes_per_token = 2 * layers * self.kv_heads * self.head_dim * self.kv.element_size()  # K and V
        self._total = np.zeros((), dtype=np.int32)  # a CPU input of GQA; bound by address
        self._steps: dict[tuple[int, int], _Step] = {}
        self._cache: SharedKVCache | None = None

    # ------------------------------------------------------------------ plumbing
    def _on_stream(self):
        return _torch().cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def _binding(self, ids, seqlens, logits, rows: slice) -> ort.IOBinding:
        binding = self.session.io_binding()
        _bind(binding, "input_ids", ids)
        _bind(binding, SEQLENS, seqlens)
        binding.bind_input(TOTAL, "cpu", 0, np.int32, [], self._total.ctypes.data)
        for i, (past, present) in enumerate(zip(self.past_names, self.present_names)):
            layer, kind = divmod(i, 2)
            buffer = self.kv[layer, kind, rows]
            _bind(binding, past, buffer)
            _bind(binding, present, buffer, output=True)  # the same memory: GQA's shared buffer
        _bind(binding, "logits", logits, output=True)
        return binding

    def _step(self, batch: int, seq: int, tail: str = "") -> _Step:
        key = (batch, seq, tail) if tail else (batch, seq)
        if key not in self._steps:
            torch = _torch()
            with self._on_stream():
                ids = torch.zeros(batch, seq, dtype=torch.int64, device=self.torch_device)
                seqlens = torch.zeros(batch, dtype=torch.int32, device=self.torch_device)
                logits = torch.zeros(batch, seq, self.vocab, dtype=self.logits_dtype, device=self.torch_device)
            options = ort.RunOptions()
            if self.graph_mode == "ort":
                options.add_run_config_entry("gpu_graph_id", str(len(self._steps) + 1))
            elif self.graph_mode == "torch":  # no stream sync at the end of Run: it may be captured
                options.add_run_config_entry("disable_synchronize_execution_providers", "1")
            self._steps[key] = _Step(ids, seqlens, logits, self._binding(ids, seqlens, logits, slice(0, batch)),
                                     options)
        return self._steps[key]

    def _run(self, binding: ort.IOBinding, options: ort.RunOptions) -> None:
        if self.stream is not None and not self.shared_stream:
            self.stream.synchronize()  # torch's writes to the bound inputs must land first
        self.session.run_with_iobinding(binding, options)

    def _plain_options(self) -> ort.RunOptions:
        options = ort.RunOptions()
        if self.graph_mode == "ort":
            options.add_run_config_entry("gpu_graph_id", "-1")  # a one-off shape: no capture
        return options

    def _replay(self, step: _Step, tail=None) -> None:
        run_captured(self, step, step.binding, step.run_options, tail)

    def _check_room(self, cache: SharedKVCache, seq: int) -> None:
        if cache.length + seq > self.capacity:
            raise UserError(f"{cache.length + seq} positions exceed the KV capacity of {self.capacity}",
                            "build or open the engine with a larger capacity, or generate fewer tokens")

    # ------------------------------------------------------------------ the Engine interface
    def new_cache(self, batch: int) -> SharedKVCache:
        """The cache over rows 0..batch-1 (one live cache per engine: the buffer is the engine's)."""
        if batch > self.max_batch:
            raise UserError(f"batch {batch} exceeds this engine's {self.max_batch} KV rows",
                            f"open the engine with max_batch >= {batch}")
        self._cache = SharedKVCache(self, batch)
        return self._cache

    def run_rows(self, ids: np.ndarray, cache: SharedKVCache):
        """All rows take S new tokens: ids [B, S] -> device logits [B, S, V] (fixed step for small S)."""
        torch = _torch()
        batch, seq = ids.shape
        self._check_room(cache, seq)
        self._total[...] = cache.length + seq
        with self._on_stream():
            if seq <= MAX_GRAPH_SEQ:
                # A graph replays what GQA's host code saw at capture: give it the buffer's bound
                # (as GenAI does); the per-row lengths live on the device (seqlens_k).
                self._total[...] = self.capacity
                step = self._step(batch, seq)
                step.ids.copy_(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)), non_blocking=False)
                step.seqlens.copy_(torch.from_numpy((cache.lengths + seq - 1).astype(np.int32)))
                self._replay(step)
                logits = step.logits
            else:
                tids = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).to(self.torch_device)
                seqlens = torch.from_numpy((cache.lengths + seq - 1).astype(np.int32)).to(self.torch_device)
                logits = torch.empty(batch, seq, self.vocab, dtype=self.logits_dtype, device=self.torch_device)
                self._run(self._binding(tids, seqlens, logits, slice(0, batch)), self._plain_options())
        cache.lengths += seq
        return logits

    def prefill_row(self, row: int, ids: Sequence[int], cache: SharedKVCache):
        """Append `ids` to row `row` alone (batch-1 binding on its slice): device logits [n, V]."""
        torch = _torch()
        n = len(ids)
        if cache.lengths[row] + n > self.capacity:
            raise UserError(f"{cache.lengths[row] + n} positions exceed the KV capacity of {self.capacity}",
                            "use a shorter prompt or a larger capacity")
        self._total[...] = cache.lengths[row] + n
        with self._on_stream():
            tids = torch.tensor([list(ids)], dtype=torch.int64, device=self.torch_device)
            seqlens = torch.tensor([cache.lengths[row] + n - 1], dtype=torch.int32, device=self.torch_device)
            logits = torch.empty(1, n, self.vocab, dtype=self.logits_dtype, device=self.torch_device)
            self._run(self._binding(tids, seqlens, logits, slice(row, row + 1)), self._plain_options())
        cache.lengths[row] += n
        return logits[0]

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: SharedKVCache) -> np.ndarray:
        """ids/positions [B, S], mask [B, P+S] -> logits [B, S, V] fp32 (numpy).

        Positions come from the cache (row b's next slot); left padding (mask 0 in the new
        columns) is dropped and the row's real tokens are appended alone; pad columns get 0."""
        batch, seq = input_ids.shape
        real = attention_mask[:, -seq:].astype(bool)
        # The host copies are queued on the engine's stream, after the run that wrote the logits
        # (on another stream they could read the reused output buffer before the replay is done).
        if real.all():
            logits = self.run_rows(input_ids, cache)
            with self._on_stream():
                return logits.float().cpu().numpy()
        out = np.zeros((batch, seq, self.vocab), dtype=np.float32)
        for row in range(batch):
            if real[row].any():
                logits = self.prefill_row(row, input_ids[row, real[row]].tolist(), cache)
                with self._on_stream():
                    out[row, real[row]] = logits.float().cpu().numpy()
        return out

    def greedy_forward(self, ids: Sequence[int], cache: SharedKVCache) -> np.ndarray:
        """Batch 1: append ids [S] and return the argmax after each of them [S] (speculative verify
        without moving logits to the host)."""
        logits = self.run_rows(np.asarray([list(ids)], dtype=np.int64), cache)
        with self._on_stream():
            return device_argmax(logits[0]).cpu().numpy()


# ----------------------------------------------------------------------------- device sampling

@functools.cache
def _chunks(vocab: int) -> int:
    """Rows for the two-stage argmax: the divisor of `vocab` nearest sqrt(vocab) (1 if none fits)."""
    best = 1
    for rows in range(2, int(vocab ** 0.5 * 2) + 1):
        if vocab % rows == 0 and abs(rows - vocab ** 0.5) < abs(best - vocab ** 0.5):
            best = rows
    return best if best >= 16 else 1


def device_argmax(logits):
    """argmax over the last axis of [..., V] on the device, ties to the first index like argmax.

    torch reduces one long row with few blocks (35 us for V = 128256 fp16 on an H200, as long as a
    decoder layer); as [rows, V/rows] it is a max per row (many blocks), then an argmax of the
    row maxima: the first row holding the maximum, and in it the first index (torch's max keeps the
    first), so the same index."""
    vocab = logits.shape[-1]
    rows = _chunks(vocab)
    if rows == 1:
        return logits.argmax(-1)
    lead = logits.shape[:-1]
    values, index = logits.reshape(*lead, rows, vocab // rows).max(-1)
    row = values.argmax(-1, keepdim=True)
    return (row * (vocab // rows) + index.gather(-1, row)).squeeze(-1)


def sample_on_device(logits, params, generator=None, seen=None):
    """Next ids [B] (torch int64) from logits [B, V] on their device, with sampling.sample's
    processors in its order (penalty, temperature, top-k, top-p) and gpt-fast's draw:
    argmax(probs / Exp(1) noise) is a sample from probs, with no host sync. `seen` [B, V] bool."""
    torch = _torch()
    if params.greedy and (seen is None or params.repetition_penalty == 1.0):
        return device_argmax(logits)  # no cast
    # float64, the penalty clipped to finite values and the temperature dividing logits shifted by their
    # maximum: what sampling.probabilities computes (no inf - inf at a tiny temperature or penalty)
    x = logits.double()
    if seen is not None and params.repetition_penalty != 1.0:
        p, finite = params.repetition_penalty, torch.finfo(torch.float64).max
        penalized = torch.where(x > 0, x / p, x * p).clamp(-finite, finite)
        x = torch.where(seen & x.isfinite(), penalized, x)
    if params.greedy:
        return x.argmax(-1)
    top = x.max(-1, keepdim=True).values
    x = torch.where(x == top, torch.zeros_like(x), (x - top) / params.temperature)
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = x.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        ordered = ordered.masked_fill(probs.cumsum(-1) - probs >= params.top_p, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, order, ordered)
    probs = x.softmax(-1)
    noise = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / noise).argmax(-1)


@dataclass
class DecodeTimes:
    prefill_s: float = 0.0
    step_s: list[float] = field(default_factory=list)


def fast_generate_ids(engine: GqaEngine, prompts: Sequence[Sequence[int]], config, pad_id: int = 0,
                      times: DecodeTimes | None = None) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """generate.generate_ids on the device: (next ids [B], finished-before-this-step [B]) per step.

    Prefill row by row, then one fixed [B, 1] step per token (a CUDA graph replay on CUDA);
    sampling stays on the device and only the ids come back. Finished rows keep running."""
    torch = _torch()
    limit = min(engine.capacity, config.max_positions or engine.capacity)
    budget = check_budget([len(p) for p in prompts], config.max_new_tokens, limit)
    params = config.sampling
    generator = None
    if not params.greedy:
        generator = torch.Generator(engine.torch_device)
        generator.manual_seed(params.seed if params.seed is not None else int(np.random.SeedSequence().entropy % 2**63))
    stop = np.array(sorted(set(config.stop_token_ids)), dtype=np.int64)
    cache = engine.new_cache(len(prompts))
    start = time.perf_counter()
    with engine._on_stream():
        seen = None
        if params.repetition_penalty != 1.0:
            seen = torch.zeros(len(prompts), engine.vocab, dtype=torch.bool, device=engine.torch_device)
            for row, p in enumerate(prompts):
                seen[row, torch.tensor(list(p), device=engine.torch_device)] = True
        logits = torch.stack([engine.prefill_row(row, p, cache)[-1] for row, p in enumerate(prompts)])
        finished = np.zeros(len(prompts), dtype=bool)

        def emit(host: np.ndarray, i: int):
            nonlocal start
            if times is not None:
                now = time.perf_counter()
                times.step_s.append(now - start) if i else setattr(times, "prefill_s", now - start)
                start = now
            out = host, finished.copy()
            finished[...] |= np.isin(host, stop)
            return out

        next_ids = sample_on_device(logits, params, generator, seen)
        # Greedy without a penalty: the argmax is part of the captured step, which feeds itself.
        in_graph = params.greedy and params.repetition_penalty == 1.0
        step = engine._step(len(prompts), 1, "greedy" if in_graph else "")
        step.seqlens.copy_(torch.from_numpy(cache.lengths.astype(np.int32)))  # seqlens_k = length before + 1 - 1
        step.ids.copy_(next_ids[:, None])
        yield emit(next_ids.cpu().numpy(), 0)
        if finished.all() or budget == 1:
            return
        engine._total[...] = engine.capacity  # see run_rows
        if in_graph:
            yield from _greedy_steps(engine, step, cache, budget, finished, emit)
            return
        for i in range(1, budget):
            if seen is not None:
                seen.scatter_(1, next_ids[:, None], True)
            engine._replay(step)
            step.seqlens.add_(1)
            cache.lengths += 1
            next_ids = sample_on_device(step.logits[:, 0], params, generator, seen)
            step.ids.copy_(next_ids[:, None])
            yield emit(next_ids.cpu().numpy(), i)  # the one host sync per token
            if finished.all():
                return


def _greedy_steps(engine: GqaEngine, step: _Step, cache: SharedKVCache, budget: int, finished, emit):
    """Tokens 1..budget-1: each replay runs the model, writes argmax into step.ids and bumps seqlens.
    On CUDA the next step is queued before the host waits for this one's ids (one step ahead)."""
    torch = _torch()

    def tail():
        step.ids.copy_(device_argmax(step.logits[:, -1])[:, None])
        step.seqlens.add_(1)

    cuda = engine.stream is not None
    if getattr(step, "slots", None) is None:  # pinned host slots, allocated once per step shape
        step.slots = torch.empty((2, step.ids.shape[0]), dtype=torch.int64, pin_memory=cuda)
        step.events = [torch.cuda.Event() for _ in range(2)] if cuda else []
    slots, events = step.slots, step.events

    def enqueue(i: int) -> None:
        engine._replay(step, tail)
        cache.lengths += 1
        slots[i % 2].copy_(step.ids[:, 0], non_blocking=cuda)
        if cuda:
            events[i % 2].record(engine.stream)

    enqueue(1)
    for i in range(1, budget):
        if i + 1 < budget:
            enqueue(i + 1)  # the GPU works on token i+1 while the host takes token i
        if cuda:
            events[i % 2].synchronize()
        yield emit(slots[i % 2].numpy().copy(), i)
        if finished.all():
            return


def kv_rows(built: int | None, wanted: int = 1) -> int:
    """KV rows to allocate for a --for-cuda engine: its build's --max-batch (build.json
    kv_layout.max_batch) when recorded, else `wanted`, the sequences to run at once."""
    if built is None:
        return max(1, wanted)
    if built > MAX_CUDA_BATCH:
        raise EngineError(f"build.json kv_layout.max_batch {built} is more than {MAX_CUDA_BATCH}",
                          "rebuild the engine with enginesmith build --for-cuda --max-batch N")
    if wanted > built:
        raise UserError(f"{wanted} sequences at once exceed the --max-batch {built} this engine was built with",
                        f"rebuild it with --max-batch {wanted} or more, or run fewer at once")
    return built


def open_gqa_engine(path: str | Path, device: str = "auto", max_batch: int = 1, capacity: int | None = None,
                    cuda_graph: bool = True, threads: int | None = None, verify_hashes: bool = True) -> LoadedEngine:
    """The GQA branch of runtime.load.open_engine (call that): a LoadedEngine whose engine is a
    GqaEngine of `max_batch` KV rows, for an engine directory built with the GQA lowering
    (build.json kv_layout.io == "gqa-shared-buffer")."""
    path = Path(path)
    manifest = engine_dir.verify(path, hashes=verify_hashes, onnx_graph=True)
    engine = GqaEngine(path / manifest.graph, device=device, max_batch=max_batch,
                       capacity=capacity or manifest.kv_layout.capacity, cuda_graph=cuda_graph, threads=threads)
    return LoadedEngine(path, manifest, engine, Tokenizer(path / "tokenizer"))
