"""TensorRT backend: build a serialized plan from the final ONNX graph, and run it as an Engine.

Written against the TensorRT Python API (10.x; 11.x accepts the same calls) and type-checked with
mypy against its stubs; TensorRT cannot be installed on this project's machines, so none of the
code that touches `tensorrt` has run here (see docs/deploy.md). `tensorrt` and CUDA (through torch)
are imported only inside the functions that need them; without TensorRT every entry point raises
a UserError that says so.

Engine directory (next to model.onnx + data, tokenizer/):
    model.plan                 the serialized engine (weights stripped with strip_weights=True)
    plugins/<lib>.so           copies of the plugin libraries the plan was built with
    build.json backend:        {name: "tensorrt", version, plan, sm, device, plugins [{file, sha256}],
                                profiles, flags, weights: "in-plan" | "refit-from-onnx", ...}

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

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from enginesmith.core import engine_dir
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.manifest import KVLayout, Manifest

if TYPE_CHECKING:
    import tensorrt as trt

PLAN = "model.plan"
PLUGIN_DIR = "plugins"
PROFILE_PREFILL, PROFILE_DECODE = 0, 1
_TRT_FIX = ("install TensorRT 10.x/11.x for this GPU (pip install tensorrt-cu12 or the JetPack package), "
            "or use the ONNX Runtime backend (--backend ort)")


def ensure_tensorrt() -> None:
    """Raise a UserError saying how to get TensorRT when `import tensorrt` fails.

    Callers then `import tensorrt as trt` locally, so mypy checks every call against the stubs.
    """
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise UserError("TensorRT is not installed (import tensorrt failed)", _TRT_FIX) from None


def require_tensorrt() -> str:
    """Check up front (before a long export) that TensorRT and a CUDA GPU are here; return the TRT version."""
    ensure_tensorrt()
    import tensorrt as trt

    version = str(trt.__version__)
    if current_sm() is None:
        raise UserError("TensorRT needs a CUDA GPU and none is visible", "run on a machine with an NVIDIA GPU")
    return version


def current_sm() -> str | None:
    """'major.minor' compute capability of CUDA device 0, or None without CUDA."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(0)
    return f"{major}.{minor}"


# ----------------------------------------------------------------------------- build

@dataclass(frozen=True)
class TrtBuildConfig:
    """What a TensorRT build needs beyond the graph; validated once in __post_init__."""

    max_batch: int = 8
    max_input: int = 1024            # most new tokens in one call (prefill chunk)
    max_positions: int = 4096        # KV capacity C: prompt + output
    opt_batch: int = 1
    opt_input: int = 128
    opt_positions: int = 512
    plugin_libraries: tuple[str, ...] = ()
    timing_cache: str | None = None  # read if present, written back after the build
    sparse_weights: bool = False     # BuilderFlag.SPARSE_WEIGHTS (2:4 weights -> sparse tensor cores)
    strip_weights: bool = False      # STRIP_PLAN + REFIT_IDENTICAL: plan without weights, refit from model.onnx.data at load
    weight_streaming: bool = False   # WEIGHT_STREAMING: weights may stay in host memory, streamed per layer
    workspace_bytes: int | None = None
    optimization_level: int = 3      # 0..5; lower builds faster with less memory
    max_aux_streams: int | None = None
    hardware_compatibility: str = "none"  # "none" | "ampere_plus" | "same_compute_capability"

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_input", "max_positions", "opt_batch", "opt_input", "opt_positions"):
            if getattr(self, name) < 1:
                raise UserError(f"invalid {name}={getattr(self, name)}", f"{name} must be >= 1")
        if not (self.opt_batch <= self.max_batch and self.opt_input <= self.max_input
                and self.opt_positions <= self.max_positions and self.max_input <= self.max_positions):
            raise UserError("optimization profile out of order",
                            "need opt_batch <= max_batch, opt_input <= max_input <= max_positions, "
                            "opt_positions <= max_positions")
        if not 0 <= self.optimization_level <= 5:
            raise UserError(f"invalid optimization_level={self.optimization_level}", "use 0..5")
        if self.hardware_compatibility not in ("none", "ampere_plus", "same_compute_capability"):
            raise UserError(f"unknown hardware_compatibility {self.hardware_compatibility!r}",
                            "use none, ampere_plus or same_compute_capability")


Shape = tuple[int, ...]


@dataclass(frozen=True)
class ProfileShapes:
    """min/opt/max per input for one optimization profile."""

    name: str
    shapes: dict[str, tuple[Shape, Shape, Shape]] = field(default_factory=dict)


def profile_shapes(inputs: dict[str, Shape], config: TrtBuildConfig) -> list[ProfileShapes]:
    """Prefill and decode profiles for the dense KV-cache I/O (see export/kv_io.py).

    `inputs` maps each network input to its ONNX shape with -1 for dynamic dims. A past input
    whose sequence dim is fixed (a static-capacity cache) keeps that size in every profile.
    """
    c, b = config, (1, config.opt_batch, config.max_batch)
    profiles = []
    for name, (s_min, s_opt, s_max) in (("prefill", (1, c.opt_input, c.max_input)), ("decode", (1, 1, 1))):
        p_opt = 0 if name == "prefill" else c.opt_positions - 1
        shapes: dict[str, tuple[Shape, Shape, Shape]] = {}
        for tensor, dims in inputs.items():
            if tensor in ("input_ids", "position_ids"):
                shapes[tensor] = ((b[0], s_min), (b[1], s_opt), (b[2], s_max))
            elif tensor == "attention_mask":
                if dims[1] != -1:  # static mask length = capacity
                    shapes[tensor] = ((b[0], dims[1]), (b[1], dims[1]), (b[2], dims[1]))
                else:
                    shapes[tensor] = ((b[0], s_min), (b[1], p_opt + s_opt), (b[2], c.max_positions))
            elif tensor.startswith("past_key_values."):
                heads, seq, dim = dims[1], dims[2], dims[3]
                if seq != -1:
                    shapes[tensor] = tuple((bb, heads, seq, dim) for bb in b)  # type: ignore[assignment]
                else:
                    shapes[tensor] = ((b[0], heads, 0, dim), (b[1], heads, p_opt, dim),
                                      (b[2], heads, c.max_positions - s_min, dim))
            elif -1 not in dims:
                shapes[tensor] = (dims, dims, dims)
            else:
                raise UserError(f"network input {tensor!r} {dims} has dynamic dims enginesmith does not know",
                                "export with `enginesmith build` (export/kv_io.py input names)")
        profiles.append(ProfileShapes(name, shapes))
    return profiles


def _dims(dims: trt.Dims) -> Shape:
    """A TensorRT Dims as a tuple (-1 for dynamic dims)."""
    return tuple(int(dims[i]) for i in range(len(dims)))


def _parse_errors(parser: trt.OnnxParser) -> str:
    return "; ".join(str(parser.get_error(i)) for i in range(min(int(parser.num_errors), 5)))


def _load_plugins(libraries: Sequence[str]) -> list[Any]:
    """Register the plugin creators of each library (getCreators) with TensorRT's registry."""
    import tensorrt as trt

    registry = trt.get_plugin_registry()
    handles = []
    for lib in libraries:
        if not Path(lib).is_file():
            raise UserError(f"plugin library {lib} does not exist",
                            "build it (cmake -S plugins -B plugins/build) or fix the path")
        handle = registry.load_library(str(lib))
        if handle is None:
            raise UserError(f"TensorRT could not load plugin library {lib}",
                            "check it was built for this TensorRT/CUDA (ldd, CMAKE_CUDA_ARCHITECTURES)")
        handles.append(handle)
    return handles


def build_plan(onnx_path: str | Path, out_dir: str | Path, config: TrtBuildConfig) -> dict:
    """Build `out_dir/model.plan` (+ plugins/) from the final graph; return build.json's backend section.

    Peak host memory stays near the size of the weights: the parser reads external data from disk
    itself (nothing is loaded in Python) and the plan is serialized straight to the file.
    """
    ensure_tensorrt()
    import tensorrt as trt

    sm = current_sm()
    if sm is None:
        raise UserError("TensorRT needs a CUDA GPU and none is visible", "run on a machine with an NVIDIA GPU")
    import torch

    onnx_path, out_dir = Path(onnx_path), Path(out_dir)
    logger = trt.Logger(trt.Logger.WARNING)
    _load_plugins(config.plugin_libraries)
    builder = trt.Builder(logger)
    # Strongly typed: precision comes from the graph. TensorRT 11 ignores the (kept) flag: always typed.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise UserError(f"TensorRT {trt.__version__} could not parse {onnx_path}: {_parse_errors(parser)}",
                        f"run `enginesmith trt-lint {onnx_path} --trt-version {trt.__version__}`")
    inputs = {}
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        inputs[tensor.name] = _dims(tensor.shape)

    builder_config = builder.create_builder_config()
    builder_config.builder_optimization_level = config.optimization_level
    if config.workspace_bytes:
        builder_config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, config.workspace_bytes)
    if config.max_aux_streams is not None:
        builder_config.max_aux_streams = config.max_aux_streams
    flags = []
    if config.sparse_weights:
        builder_config.set_flag(trt.BuilderFlag.SPARSE_WEIGHTS)
        flags.append("SPARSE_WEIGHTS")
    if config.strip_weights:
        builder_config.set_flag(trt.BuilderFlag.STRIP_PLAN)
        builder_config.set_flag(trt.BuilderFlag.REFIT_IDENTICAL)
        flags += ["STRIP_PLAN", "REFIT_IDENTICAL"]
    if config.weight_streaming:
        builder_config.set_flag(trt.BuilderFlag.WEIGHT_STREAMING)
        flags.append("WEIGHT_STREAMING")
    if config.plugin_libraries:  # PagedAttention writes its cache in place (aliased plugin I/O)
        builder_config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    if config.hardware_compatibility != "none":
        builder_config.hardware_compatibility_level = getattr(
            trt.HardwareCompatibilityLevel, config.hardware_compatibility.upper())
    profiles = profile_shapes(inputs, config)
    for prof in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in prof.shapes.items():
            profile.set_shape(name, trt.Dims(list(lo)), trt.Dims(list(opt)), trt.Dims(list(hi)))
        builder_config.add_optimization_profile(profile)

    cache_path = Path(config.timing_cache) if config.timing_cache else None
    cache_bytes = cache_path.read_bytes() if cache_path and cache_path.is_file() else b""
    timing_cache = builder_config.create_timing_cache(cache_bytes)
    builder_config.set_timing_cache(timing_cache, False)

    serialized = builder.build_serialized_network(network, builder_config)
    if serialized is None:
        raise UserError(f"TensorRT could not build an engine from {onnx_path} (see the log above)",
                        "check the profile sizes fit GPU memory, or lower max_batch / max_input")
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / PLAN, memoryview(serialized))
    if cache_path is not None:
        _write_atomic(cache_path, memoryview(builder_config.get_timing_cache().serialize()))

    plugins = []
    for lib in config.plugin_libraries:
        rel = f"{PLUGIN_DIR}/{Path(lib).name}"
        (out_dir / PLUGIN_DIR).mkdir(exist_ok=True)
        shutil.copy2(lib, out_dir / rel)
        plugins.append({"file": rel, "sha256": engine_dir.sha256(out_dir / rel), "source": str(lib)})
    return {
        "name": "tensorrt", "version": str(trt.__version__), "plan": PLAN, "sm": sm,
        "device": torch.cuda.get_device_name(0), "plugins": plugins,
        "profiles": {p.name: {k: [list(s) for s in v] for k, v in p.shapes.items()} for p in profiles},
        "flags": flags, "weights": "refit-from-onnx" if config.strip_weights else "in-plan",
        "weight_streaming": config.weight_streaming, "hardware_compatibility": config.hardware_compatibility,
        "max_batch": config.max_batch, "max_input": config.max_input, "max_positions": config.max_positions,
    }


def _write_atomic(path: Path, data: memoryview) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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


@dataclass
class LoadedTrtEngine:
    """The TensorRT counterpart of runtime.load.LoadedEngine (same fields and properties)."""

    path: Path
    manifest: Manifest
    engine: "TrtEngine"
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
        return self.max_positions


def open_trt_engine(path: str | Path, plugin_libraries: Sequence[str] = (), verify_hashes: bool = True,
                    weight_budget_bytes: int | None = None, cuda_graphs: bool = True) -> LoadedTrtEngine:
    """Verify build.json, load plugins, deserialize (and refit) the plan, and open the tokenizer.

    `plugin_libraries` overrides the copies in the engine directory (Triton passes its paths).
    """
    from enginesmith.runtime.tokenizer import Tokenizer

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
    _load_plugins(libraries)
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


class TrtEngine:
    """forward(ids, mask, positions, cache) -> logits [B, S, V] float32, over one execution context."""

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
        self.past = [n for n in self.inputs if n.startswith("past_key_values.")]
        self.present = [n for n in self.outputs if n.startswith("present.")]
        self.dtypes = {n: _torch_dtype(cuda_engine.get_tensor_dtype(n)) for n in names}
        first = _dims(cuda_engine.get_tensor_shape(self.past[0]))
        self.kv_heads, self.head_dim = int(first[1]), int(first[3])
        self.in_place = int(first[2]) != -1             # fixed-capacity cache (IKVCacheUpdateLayer)
        self.mask_len = _dims(cuda_engine.get_tensor_shape("attention_mask"))[1]  # -1 or C
        self.vocab = _dims(cuda_engine.get_tensor_shape("logits"))[-1]
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
