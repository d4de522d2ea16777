"""TensorRT backend: open a plan built by enginesmith/builder/trt_plan.py and run it as an Engine.

Written against the TensorRT Python API (10.x; 11.x accepts the same calls) and type-checked with
mypy against its stubs; TensorRT cannot be installed on this project's machines, so none of the
code that touches `tensorrt` has run here (see docs/deploy.md). `tensorrt` and CUDA (through torch)
are imported only inside the functions that need them; without TensorRT every entry point raises
a UserError that says so.

Engine directory (next to model.onnx + data, tokenizer/): model.plan, plugins/<lib>.so, and
build.json's backend section (see enginesmith/builder/trt_plan.py for what the builder writes).

Dimension legend: B batch, S new tokens, P cached positions, T = P + S, V vocab, Hkv KV heads, D head dim.
Two optimization profiles: 0 "prefill" (S in 1..max_input) and 1 "decode" (S = 1).

KV cache. A dense export grows the cache by Concat (past [B,Hkv,P,D] -> present [B,Hkv,P+S,D]).
The runner keeps two device buffers of capacity C per layer and ping-pongs: a step reads past from
one and writes present into the other, so nothing is copied and each buffer's address is fixed
(two address tables, bound with set_tensor_address). Decode shapes change every step there, so
CUDA graphs are used only for engines whose cache has a fixed capacity (TensorScatter ->
IKVCacheUpdateLayer, present aliasing past): one graph per batch size, captured after one warm-up
enqueue, replayed for every decode step with inputs copied into the same static buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import numpy as np

from enginesmith.core import engine_dir, io_names
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.manifest import Manifest
from enginesmith.core.tensorrt import current_sm, ensure_tensorrt, load_plugins, shape_of
from enginesmith.runtime.protocols import LoadedEngine
from enginesmith.runtime.text.tokenizer import Tokenizer

if TYPE_CHECKING:
    import tensorrt as trt

PROFILE_PREFILL, PROFILE_DECODE = 0, 1


# ----------------------------------------------------------------------------- load

def check_manifest(manifest: Manifest, sm: str | None, trt_version: str | None) -> None:
    """Refuse an engine this machine cannot run, saying why and what to do (no TensorRT needed)."""
    backend = manifest.backend
    if backend.name != "tensorrt":
        raise EngineError(f"this engine was built for backend {backend.name!r}, not TensorRT",
                          "open it with the ONNX Runtime runtime, or rebuild with `enginesmith build --backend trt`")
    if trt_version is not None and backend.version != trt_version and "VERSION_COMPATIBLE" not in backend.flags:
        raise EngineError(f"the plan was built with TensorRT {backend.version}, this is TensorRT {trt_version}",
                          f"rebuild the engine here, or install TensorRT {backend.version}")
    built_sm = backend.sm
    if sm is None:
        raise EngineError("this TensorRT engine needs a CUDA GPU and none is visible",
                          "run it on the GPU it was built for, or use an ONNX Runtime engine")
    if built_sm != sm:
        compat = backend.hardware_compatibility
        ok = (compat == "ampere_plus" and float(sm) >= 8.0) or \
             (compat == "same_compute_capability" and built_sm and sm.split(".")[0] == built_sm.split(".")[0])
        if not ok:
            raise EngineError(f"the plan was built for SM {built_sm} ({backend.device or '?'}), this GPU is SM {sm}",
                              "rebuild the engine on this GPU (TensorRT plans are specific to the GPU architecture)")
    if backend.plan is None or backend.max_batch is None or backend.max_input is None \
            or backend.max_positions is None:
        raise EngineError("build.json's TensorRT backend lacks plan, max_batch, max_input or max_positions",
                          "rebuild the engine with `enginesmith build --backend trt`")


class LoadedTrtEngine(LoadedEngine):
    """runtime.load.LoadedEngine for a TensorRT plan: its profile's max_positions bounds every layout."""

    @property
    def context_limit(self) -> int | None:
        return self.max_positions


def open_trt_engine(path: str | Path, plugin_libraries: Sequence[str] = (), verify_hashes: bool = True,
                    weight_budget_bytes: int | None = None, cuda_graphs: bool = True) -> LoadedTrtEngine:
    """Verify build.json, load plugins, deserialize (and refit) the plan, and open the tokenizer.

    `plugin_libraries` overrides the copies in the engine directory (Triton passes its paths).
    """
    path = Path(path)
    manifest = engine_dir.read_manifest(path)
    check_manifest(manifest, current_sm(), None)  # clear errors before TensorRT is even imported
    libraries = list(plugin_libraries) or [str(path / e.file) for e in manifest.backend.plugins]
    for lib in libraries:
        if not Path(lib).is_file():
            raise EngineError(f"plugin library {lib} is missing", "rebuild the engine or restore the library")
    ensure_tensorrt()
    import tensorrt as trt

    manifest = engine_dir.verify(path, lambda m: check_manifest(m, current_sm(), str(trt.__version__)),
                                 hashes=verify_hashes)
    backend = manifest.backend
    assert backend.plan and backend.max_batch and backend.max_input and backend.max_positions  # check_manifest
    logger = trt.Logger(trt.Logger.WARNING)
    load_plugins(libraries)
    runtime = trt.Runtime(logger)
    cuda_engine = runtime.deserialize_cuda_engine((path / backend.plan).read_bytes())
    if cuda_engine is None:
        raise EngineError(f"TensorRT could not deserialize {path / backend.plan}",
                          "rebuild the engine with this TensorRT and plugin library")
    if backend.weights == "refit-from-onnx":
        refitter = trt.Refitter(cuda_engine, logger)
        onnx_refitter = trt.OnnxParserRefitter(refitter, logger)
        if not onnx_refitter.refit_from_file(str(path / manifest.graph)) or not refitter.refit_cuda_engine():
            raise EngineError(f"refitting the weights of {path} from {manifest.graph} failed",
                              "rebuild the engine (the graph and the stripped plan do not match)")
    if backend.weight_streaming and weight_budget_bytes is not None:
        cuda_engine.weight_streaming_budget_v2 = weight_budget_bytes
    engine = TrtEngine(cuda_engine, max_batch=backend.max_batch, max_input=backend.max_input,
                       capacity=backend.max_positions, cuda_graphs=cuda_graphs)
    return LoadedTrtEngine(path, manifest, engine, Tokenizer(path / "tokenizer"))


# ----------------------------------------------------------------------------- run

_TORCH_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16", "int64": "int64",
                 "int32": "int32", "bool": "bool"}


def _torch_dtype(dtype: trt.DataType) -> Any:
    import tensorrt as trt
    import torch

    if dtype == trt.DataType.BF16:  # numpy has no bfloat16
        return torch.bfloat16
    return getattr(torch, _TORCH_DTYPES[np.dtype(trt.nptype(dtype)).name])


class TrtKVCache:
    """Per layer, two device buffers of capacity C (ping-pong) or one (fixed-capacity, in place).

    The buffers belong to the engine (one set per batch size, so addresses and CUDA graphs survive
    from one generation to the next); a cache is a view of them: length P and which copy is current.
    """

    rollback: ClassVar[bool] = True  # protocols.KVCache
    evicts: ClassVar[bool] = False

    def __init__(self, buffers: list[list[Any]], batch: int, kv_heads: int, head_dim: int, in_place: bool) -> None:
        self.buffers = buffers        # [layer*2 + k/v][copy] -> flat tensor of B*Hkv*C*D on the GPU
        self.batch, self.kv_heads, self.head_dim = batch, kv_heads, head_dim
        self.in_place = in_place
        self.length = 0               # P
        self.parity = 0               # which copy holds the current cache (ping-pong only)

    def truncate(self, length: int) -> None:
        """Drop positions >= length (speculative-decoding rollback)."""
        if length >= self.length:
            return
        if not self.in_place:  # dense [B,Hkv,P,D] -> [B,Hkv,L,D] into the other copy
            b, h, d, p = self.batch, self.kv_heads, self.head_dim, self.length
            for copies in self.buffers:
                src = copies[self.parity][: b * h * p * d].view(b, h, p, d)
                copies[1 - self.parity][: b * h * length * d].view(b, h, length, d).copy_(src[:, :, :length])
            self.parity = 1 - self.parity
        self.length = length

    def nbytes(self) -> int:
        return sum(int(t.numel() * t.element_size()) for copies in self.buffers for t in copies)


class TrtEngine:
    """forward(ids, mask, positions, cache) -> logits [B, S, V] float32, over one execution context."""

    device: str = "cuda"  # protocols.Engine
    device_decode: ClassVar[bool] = False

    def __init__(self, cuda_engine: trt.ICudaEngine, max_batch: int, max_input: int, capacity: int,
                 cuda_graphs: bool = True) -> None:
        import tensorrt as trt
        import torch

        self.cuda_engine = cuda_engine
        self.context = cuda_engine.create_execution_context()
        self.stream = torch.cuda.Stream()
        self.max_batch, self.max_input, self.capacity = max_batch, max_input, capacity
        names = [cuda_engine.get_tensor_name(i) for i in range(cuda_engine.num_io_tensors)]
        self.inputs = [n for n in names if cuda_engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if cuda_engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.past = [n for n in self.inputs if io_names.is_past(n)]
        self.present = [n for n in self.outputs if io_names.is_present(n)]
        self.dtypes = {n: _torch_dtype(cuda_engine.get_tensor_dtype(n)) for n in names}
        first = shape_of(cuda_engine.get_tensor_shape(self.past[0]))
        self.kv_heads, self.head_dim = int(first[1]), int(first[3])
        self.in_place = int(first[2]) != -1             # fixed-capacity cache (IKVCacheUpdateLayer)
        self.mask_len = shape_of(cuda_engine.get_tensor_shape("attention_mask"))[1]  # -1 or C
        self.vocab = shape_of(cuda_engine.get_tensor_shape("logits"))[-1]
        self.cuda_graphs = cuda_graphs and self.in_place
        dev = torch.device("cuda", torch.cuda.current_device())
        # Static buffers, bound once: the largest shapes of any profile.
        self.buf = {
            "input_ids": torch.zeros(max_batch * max_input, dtype=self.dtypes["input_ids"], device=dev),
            "position_ids": torch.zeros(max_batch * max_input, dtype=self.dtypes["position_ids"], device=dev),
            "attention_mask": torch.zeros(max_batch * capacity, dtype=self.dtypes["attention_mask"], device=dev),
            "logits": torch.empty(max_batch * max_input * self.vocab, dtype=self.dtypes["logits"], device=dev),
        }
        if "write_indices" in self.inputs:  # fixed-capacity layouts: where each row writes its new K/V
            self.buf["write_indices"] = torch.zeros(max_batch, dtype=self.dtypes["write_indices"], device=dev)
        for name, tensor in self.buf.items():
            self.context.set_tensor_address(name, tensor.data_ptr())
        self.kv_pool: dict[int, list[list[Any]]] = {}
        self.profile = -1
        self.graphs: dict[tuple, Any] = {}
        self.warm: set[tuple] = set()

    def new_cache(self, batch: int) -> TrtKVCache:
        """An empty cache over the engine's buffers for `batch` (one live cache per batch size)."""
        import torch

        if not 1 <= batch <= self.max_batch:
            raise UserError(f"batch {batch} is outside this engine's profile (1..{self.max_batch})",
                            f"rebuild with max_batch >= {batch}")
        if batch not in self.kv_pool:
            size = batch * self.kv_heads * self.capacity * self.head_dim
            copies = 1 if self.in_place else 2
            self.kv_pool[batch] = [[torch.zeros(size, dtype=self.dtypes[name], device="cuda") for _ in range(copies)]
                                   for name in self.past]
        return TrtKVCache(self.kv_pool[batch], batch, self.kv_heads, self.head_dim, self.in_place)

    def _bind_cache(self, cache: TrtKVCache) -> None:
        src, dst = (0, 0) if cache.in_place else (cache.parity, 1 - cache.parity)
        for i, (past, present) in enumerate(zip(self.past, self.present)):
            self.context.set_tensor_address(past, cache.buffers[i][src].data_ptr())
            self.context.set_tensor_address(present, cache.buffers[i][dst].data_ptr())

    def forward(self, input_ids: np.ndarray, attention_mask: np.ndarray, position_ids: np.ndarray,
                cache: TrtKVCache) -> np.ndarray:
        """input_ids/position_ids [B, S], attention_mask [B, P+S]; logits [B, S, V] float32."""
        import torch

        b, s = input_ids.shape
        p = cache.length
        if b != cache.batch or s > self.max_input or p + s > self.capacity:
            raise UserError(f"step of batch {b} x {s} tokens at position {p} exceeds the engine "
                            f"(batch {cache.batch}, {self.max_input} tokens a call, {self.capacity} positions)",
                            "rebuild with larger max_batch / max_input / max_positions")
        profile = PROFILE_DECODE if s == 1 else PROFILE_PREFILL
        with torch.cuda.stream(self.stream):
            if profile != self.profile:
                self.context.set_optimization_profile_async(profile, self.stream.cuda_stream)
                self.profile = profile
            t = attention_mask.shape[1] if self.mask_len == -1 else self.mask_len
            mask = np.zeros((b, t), dtype=np.int64)
            mask[:, :attention_mask.shape[1]] = attention_mask
            self._upload("input_ids", input_ids, b * s)
            self._upload("position_ids", position_ids, b * s)
            self._upload("attention_mask", mask, b * t)
            if "write_indices" in self.buf:
                self._upload("write_indices", np.full(b, p, dtype=np.int64), b)
                self.context.set_input_shape("write_indices", (b,))
            self.context.set_input_shape("input_ids", (b, s))
            self.context.set_input_shape("position_ids", (b, s))
            self.context.set_input_shape("attention_mask", (b, t))
            past_len = self.capacity if cache.in_place else p
            for name in self.past:
                self.context.set_input_shape(name, (b, self.kv_heads, past_len, self.head_dim))
            self._bind_cache(cache)
            key = (profile, b, s, t, cache.parity)  # addresses are fixed per batch size and parity
            if self.cuda_graphs and profile == PROFILE_DECODE:
                self._run_graph(key)
            elif not self.context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
            logits = self.buf["logits"][: b * s * self.vocab].view(b, s, self.vocab).float().cpu()
        self.stream.synchronize()
        cache.length = p + s
        if not cache.in_place:
            cache.parity = 1 - cache.parity
        return np.asarray(logits.numpy(), dtype=np.float32)

    def _upload(self, name: str, array: np.ndarray, count: int) -> None:
        import torch

        host = torch.from_numpy(np.ascontiguousarray(array).reshape(-1)).to(self.dtypes[name])
        self.buf[name][:count].copy_(host, non_blocking=False)

    def _run_graph(self, key: tuple) -> None:
        """Replay the decode graph for this shape/cache, capturing it after one plain (warm-up) enqueue."""
        import torch

        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.warm:  # TensorRT must enqueue once outside capture to set up its state
                self.warm.add(key)
                if not self.context.execute_async_v3(self.stream.cuda_stream):
                    raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log)")
                return
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                self.context.execute_async_v3(self.stream.cuda_stream)
            self.graphs[key] = graph
        graph.replay()
