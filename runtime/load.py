"""Open an engine directory: verify build.json, then the backend session and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from enginesmith.core import engine_dir
from enginesmith.core.errors import EngineError
from enginesmith.core.manifest import KVLayout, Manifest
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.runtime.ort_engine import OrtEngine, resolve_device
from enginesmith.runtime.tokenizer import Tokenizer


@dataclass
class LoadedEngine:
    path: Path
    manifest: Manifest
    engine: OrtEngine
    tokenizer: object

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


# Every exception type ONNX Runtime's binding raises (all plain Exception subclasses).
ORT_ERRORS = tuple(t for t in vars(ort.capi.onnxruntime_pybind11_state).values()
                   if isinstance(t, type) and issubclass(t, Exception))


def check_backend(manifest: Manifest) -> None:
    if manifest.backend.name != "onnxruntime":
        raise EngineError(f"this engine was built for backend {manifest.backend.name!r}; this runtime runs "
                          "onnxruntime engines", "rebuild with `enginesmith build --backend ort`")


def open_engine(path: str | Path, device: str = "auto", threads: int | None = None,
                verify_hashes: bool = True, plugin_libraries: Sequence[str] = ()) -> LoadedEngine:
    """The one front door: TensorRT plans, CUDA-lowered (GroupQueryAttention) and plain ORT engines."""
    path = Path(path)
    layout = engine_dir.read_manifest(path)
    if layout.backend.name == "tensorrt":
        from enginesmith.runtime.trt_engine import open_trt_engine

        return open_trt_engine(path, plugin_libraries=plugin_libraries, verify_hashes=verify_hashes)
    if layout.kv_layout.io == "gqa-shared-buffer":
        from enginesmith.runtime.ort_cuda import open_gqa_engine

        return open_gqa_engine(path, device=device)
    manifest = engine_dir.verify(path, check_backend, hashes=verify_hashes, onnx_graph=True)
    if manifest.precision.startswith("bf16") and resolve_device(device) == "cpu":
        raise EngineError(f"{path} is a bf16 engine; ONNX Runtime runs bf16 MatMul only on CUDA",
                          "use --device cuda with onnxruntime-gpu, or build with --dtype fp16 or fp32 for CPU")
    try:
        engine = OrtEngine(path / manifest.graph, device=device, threads=threads)
    except ORT_ERRORS as exc:  # e.g. an opset newer than this ORT, or a graph that does not run
        built = manifest.backend.version or "another version"
        raise EngineError(f"onnxruntime {ort.__version__} cannot load {path} (built with onnxruntime {built}): "
                          f"{str(exc).splitlines()[0][:200]}",
                          f"install onnxruntime {built}, or {engine_dir.rebuild_fix(path, manifest.raw)}") from None
    tokenizer = Tokenizer(path / "tokenizer")
    return LoadedEngine(path, manifest, engine, tokenizer)
