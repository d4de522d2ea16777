"""Open an engine directory: verify build.json, then the backend session and the tokenizer.

`open_engine` is the one front door (the CLI, the Triton model, measure and tests call it):

    build.json backend "tensorrt"                  -> trt_engine.open_trt_engine  (TrtEngine)
    kv_layout.io "gqa-shared-buffer" (--for-cuda)  -> ort_cuda.open_gqa_engine    (GqaEngine)
    kv_layout.io "paged-gqa" (--for-cuda --kv paged) -> paged_cuda.open_paged_engine (PagedCudaEngine)
    any other onnxruntime engine                   -> OrtEngine (dense, ring or paged KV cache)

`open_drafter` opens speculative decoding's drafter the same way (an n-gram drafter, or a draft engine).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from enginesmith.core import engine_dir
from enginesmith.core.errors import EngineError, UserError
from enginesmith.core.manifest import Manifest
from enginesmith.core.onnxruntime_flavour import onnxruntime as ort  # checked: one line if missing or mixed
from enginesmith.core.io_names import GQA_IO, PAGED_GQA_IO
from enginesmith.runtime.engines.ort_cuda import kv_rows, open_gqa_engine
from enginesmith.runtime.engines.ort_paged_model import OrtPagedModel
from enginesmith.runtime.engines.ort_engine import OrtEngine, resolve_device
from enginesmith.runtime.engines.paged_cuda import open_paged_engine
from enginesmith.runtime.protocols import LoadedEngine
from enginesmith.runtime.text.tokenizer import Tokenizer
from enginesmith.runtime.engines.trt_engine import open_trt_engine
from enginesmith.runtime.decoding.speculative import ModelDrafter, NgramDrafter, check_compatible, draft_model


# Every exception type ONNX Runtime's binding raises (all plain Exception subclasses).
ORT_ERRORS = tuple(t for t in vars(ort.capi.onnxruntime_pybind11_state).values()
                   if isinstance(t, type) and issubclass(t, Exception))


def check_backend(manifest: Manifest) -> None:
    if manifest.backend.name != "onnxruntime":
        raise EngineError(f"this engine was built for backend {manifest.backend.name!r}; this runtime runs "
                          "onnxruntime engines", "rebuild with `enginesmith build --backend ort`")


def open_engine(path: str | Path, device: str = "auto", threads: int | None = None,
                verify_hashes: bool = True, plugin_libraries: Sequence[str] = (),
                max_batch: int | None = None, num_pages: int | None = None,
                gpu_memory_utilization: float = 0.9) -> LoadedEngine:
    """The one front door: TensorRT plans, CUDA-lowered (GroupQueryAttention) and plain ORT engines.

    device/threads: the ONNX Runtime session's (a TensorRT plan runs on the GPU it was built for).
    max_batch: the most sequences run at once; a CUDA-lowered engine allocates that many KV rows,
    or its build's --max-batch (checked against it); a paged CUDA engine runs up to max_batch rows per
    step over a pool of num_pages pages (default: gpu_memory_utilization of the GPU). plugin_libraries: TensorRT plugin libraries
    in place of the engine directory's copies (Triton passes its paths). verify_hashes: hash every
    file listed in build.json (sizes are always checked)."""
    path = Path(path)
    layout = engine_dir.read_manifest(path)
    if layout.backend.name == "tensorrt":
        return open_trt_engine(path, plugin_libraries=plugin_libraries, verify_hashes=verify_hashes)
    if layout.kv_layout.io == GQA_IO:
        return open_gqa_engine(path, device=device, max_batch=kv_rows(layout.kv_layout.max_batch, max_batch or 1),
                               threads=threads, verify_hashes=verify_hashes)
    if layout.kv_layout.io == PAGED_GQA_IO:
        return open_paged_engine(path, device=device, max_batch=max_batch if max_batch and max_batch > 1 else None,
                                 num_pages=num_pages, gpu_memory_utilization=gpu_memory_utilization,
                                 threads=threads, verify_hashes=verify_hashes)
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


def paged_model(loaded: LoadedEngine, num_pages: int | None = None, memory_bytes: int = 1 << 30):
    """The PagedModel the ContinuousBatcher drives for an opened paged engine: the CUDA paged engine
    itself, or a plain ONNX Runtime paged graph with a pool of `num_pages` (default: what fits in
    `memory_bytes`). A UserError for an engine without paged KV."""
    engine = loaded.engine
    if getattr(engine, "is_paged_model", False):
        return engine
    if loaded.manifest.kv_layout.type != "paged" or not isinstance(engine, OrtEngine):
        raise UserError(f"{loaded.path} has no paged KV cache, which serving many requests at once needs",
                        "build it with --kv paged (and --for-cuda for the GPU engine)")
    page_size = int(loaded.manifest.kv_layout.page_size or 16)
    per_page = len(engine.past_names) * page_size * engine.kv_heads * engine.head_dim * 4  # K and V, fp32 bound
    pages = num_pages or max(2, min(1 << 16, memory_bytes // max(per_page, 1)))
    return OrtPagedModel(engine, pages, loaded.manifest.kv_layout.capacity)


def open_drafter(source: str | Path | LoadedEngine, target_vocab: int, target_tokenizer=None,
                 device: str = "auto", threads: int | None = None):
    """`"ngram"` -> NgramDrafter; `"draft:DIR"`, an engine directory DIR or an opened LoadedEngine
    -> ModelDrafter. Refuses a draft whose vocabulary differs from the target's. The runtime opens
    engine directories only: the caller builds a model spec first (the CLI, like --model)."""
    if isinstance(source, str):
        source = draft_model(source)
        if source is None:
            return NgramDrafter()
    draft = source if isinstance(source, LoadedEngine) else open_engine(source, device=device, threads=threads)
    check_compatible(draft.engine.vocab, target_vocab, draft.tokenizer, target_tokenizer)
    return ModelDrafter(draft.engine)
