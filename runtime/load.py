"""Open an engine directory: verify build.json, then the backend session and the tokenizer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from enginesmith import engine_dir
from enginesmith.errors import EngineError
from enginesmith.runtime.ort_engine import OrtEngine, resolve_device
from enginesmith.runtime.tokenizer import Tokenizer


@dataclass
class LoadedEngine:
    path: Path
    manifest: dict
    engine: OrtEngine
    tokenizer: object

    @property
    def max_positions(self) -> int:
        return int(self.manifest["model"]["max_positions"])

    @property
    def pad_id(self) -> int:
        return int(self.manifest["model"].get("pad_token_id") or 0)

    @property
    def kv_layout(self) -> dict:
        return self.manifest.get("kv_layout", {"type": "dense"})

    @property
    def context_limit(self) -> int | None:
        """Most tokens one sequence may hold: the model's context, None for a ring cache (streams)."""
        return None if self.kv_layout.get("type") == "ring" else self.max_positions


def check_backend(manifest: dict) -> None:
    backend = manifest.get("backend", {})
    if backend.get("name") != "onnxruntime":
        raise EngineError(f"this engine was built for backend {backend.get('name')!r}; this runtime runs "
                          "onnxruntime engines", "rebuild with `enginesmith build --backend ort`")
    if manifest.get("kv_layout", {}).get("type", "dense") not in ("dense", "ring", "paged"):
        raise EngineError(f"KV layout {manifest['kv_layout']['type']!r} is not supported by this runtime",
                          "rebuild with the dense KV layout")


def open_engine(path: str | Path, device: str = "auto", threads: int | None = None,
                verify_hashes: bool = True) -> LoadedEngine:
    """The one front door: TensorRT plans, CUDA-lowered (GroupQueryAttention) and plain ORT engines."""
    path = Path(path)
    layout = engine_dir.read_manifest(path)
    if layout.get("backend", {}).get("name") == "tensorrt":
        from enginesmith.runtime.trt_engine import open_trt_engine

        return open_trt_engine(path, verify_hashes=verify_hashes)
    if layout.get("kv_layout", {}).get("io") == "gqa-shared-buffer":
        from enginesmith.runtime.ort_cuda import open_gqa_engine

        return open_gqa_engine(path, device=device)
    manifest = engine_dir.verify(path, check_backend, hashes=verify_hashes)
    if str(manifest.get("precision", "")).startswith("bf16") and resolve_device(device) == "cpu":
        raise EngineError(f"{path} is a bf16 engine; ONNX Runtime runs bf16 MatMul only on CUDA",
                          "use --device cuda with onnxruntime-gpu, or build with --dtype fp16 or fp32 for CPU")
    try:
        engine = OrtEngine(path / manifest["graph"], device=device, threads=threads)
    except ort.capi.onnxruntime_pybind11_state.Fail as exc:  # e.g. opset newer than this ORT
        raise EngineError(f"onnxruntime {ort.__version__} cannot load {path}: {str(exc).splitlines()[0]}",
                          "rebuild the engine with this onnxruntime, or install the one it was built with") from None
    tokenizer = Tokenizer(path / "tokenizer")
    return LoadedEngine(path, manifest, engine, tokenizer)
