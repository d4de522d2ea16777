"""`enginesmith build`: model source -> export -> passes -> engine directory (atomically).

The default engine (embedded SmolLM2, fp32, ORT) is built on first use by `run`/`chat` and cached
under the cache dir, keyed by the source's hash and the build settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from enginesmith import __version__
from enginesmith.core import engine_dir
from enginesmith.core.errors import UserError
from enginesmith.core.paths import cache_dir

BACKENDS = ("ort", "trt")
_LATER_FIELDS = ("page_size", "accuracy_level", "quant", "block_size", "alpha", "calib_text", "calib_samples", "trt", "preset",
                 "trt_version")
KV_LAYOUTS = ("dense", "ring", "paged")


@dataclass(frozen=True)
class BuildConfig:
    model: str | None = None     # see models.load.resolve
    dtype: str = "fp32"
    opset: int = 23
    backend: str = "ort"         # "ort" | "trt"
    kv_layout: str = "dense"     # "ring": StreamingLLM cache of kv_sinks + kv_window slots
    kv_sinks: int = 4
    kv_window: int = 1020
    page_size: int = 16          # "paged": tokens per KV page (block)
    # graph passes (enginesmith.passes): a preset and/or an explicit pipeline, then the lowering
    quant: str | None = None     # w8a8-naive | w8a8-sq | w4a16-rtn | w4a16-awq
    passes: str | None = None    # e.g. "smoothquant:alpha=0.6,quantize_w8a8"
    block_size: int = 128        # W4A16 block along K
    alpha: float | None = None   # SmoothQuant strength; None = searched per layer
    calib_text: str | None = None  # calibration text file (default: the Austen corpus)
    calib_samples: int = 32
    accuracy_level: int = 0      # ORT MatMulNBits: 0 = fp activations, 4 = int8 activations (faster on CPU)
    # TensorRT (backend "trt"): a deploy.trt_build.TrtBuildConfig, a Jetson preset, a lint target
    trt: object | None = None
    preset: str | None = None
    trt_version: str | None = None

    def __post_init__(self):
        if self.kv_layout not in KV_LAYOUTS:
            raise UserError(f"unknown KV layout {self.kv_layout!r}", f"use one of: {', '.join(KV_LAYOUTS)}")
        if self.kv_layout == "ring" and (self.kv_sinks < 0 or self.kv_window < 1):
            raise UserError(f"a ring KV cache needs sinks >= 0 and a window >= 1 (got --sinks {self.kv_sinks}, "
                            f"--kv-window {self.kv_window})", "e.g. --sinks 4 --kv-window 1020")

    def key(self, source_sha: str) -> str:
        """Cache key of the engine this config builds from a source."""
        fields = {k: v for k, v in asdict(self).items() if k != "model"}
        if self.kv_layout == "dense":  # dense engines keep the keys they had before the kv_ options
            fields = {k: v for k, v in fields.items() if not k.startswith("kv_")}
        # plain engines keep the keys they had before the pass and TensorRT options
        plain = BuildConfig()
        fields = {k: v for k, v in fields.items()
                  if k not in _LATER_FIELDS or v != getattr(plain, k)}
        fields["passes"] = fields.get("passes") or []
        settings = json.dumps(fields, sort_keys=True)
        return f"{source_sha[:16]}-{hashlib.sha256((settings + __version__).encode()).hexdigest()[:12]}"


@contextmanager
def _stages(names: list[str], enabled: bool = True):
    """A progress bar over build stages that keeps ticking (elapsed time) during long ones."""
    bar = tqdm(total=len(names), desc="build", unit="stage", disable=not enabled, file=sys.stderr,
               bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}] {postfix}",
               mininterval=0 if sys.stderr.isatty() else 30)
    stop = threading.Event()

    def tick():
        while not stop.wait(1.0 if sys.stderr.isatty() else 30.0):
            bar.refresh()

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()

    def stage(name: str):
        if bar.n or getattr(stage, "started", False):
            bar.update(1)
        stage.started = True
        bar.set_postfix_str(name)

    try:
        yield stage
        bar.update(1)
        bar.set_postfix_str("done")
    finally:
        stop.set()
        thread.join()
        bar.close()


def build(config: BuildConfig, out: Path, force: bool = False, progress: bool = True, locked: bool = False,
          replace_any: bool = False) -> Path:
    """Build an engine directory at `out`; nothing is left at `out` if this fails or is interrupted.
    Another build writing `out` at the same time is refused (`locked`: the caller holds its lock).
    `force` replaces only an engine directory (`replace_any`: whatever is there, for our own cache)."""
    import torch
    import transformers

    from enginesmith.core.onnxruntime_flavour import require as require_onnxruntime

    ort = require_onnxruntime()  # missing or mixed ONNX Runtime: one line before minutes of export

    from enginesmith.export.kv_io import KVShape
    from enginesmith.export.to_onnx import export
    from enginesmith.models import load as models

    if config.backend not in BACKENDS:
        raise UserError(f"unknown backend {config.backend!r}", f"use one of: {', '.join(BACKENDS)}")
    trt_version = _check_tensorrt(config) if config.backend == "trt" else None  # before minutes of export
    dtype, opset = _export_settings(config)
    steps = pipeline(config)
    source = models.resolve(config.model)
    out = Path(out)
    started = time.time()
    report: list[dict] = []
    trt = config.backend == "trt"
    names = ["load", "export"] + ["passes"] * bool(steps) + ["tokenizer"] + ["tensorrt"] * trt + ["manifest"]
    with engine_dir.write_atomically(
            out, overwrite=force, locked=locked,
            replaceable=(lambda _: True) if replace_any else engine_dir.looks_like_engine) as tmp, _stages(names, progress) as stage:
        stage("load model")
        loaded = models.load(source)
        kv_layout = _kv_layout(config, KVShape.of(loaded.model.config).max_positions)
        stage("export to ONNX")
        if steps:  # passes start from the plain dense export, built once and cached
            plain = replace(config, kv_layout="dense", quant=None, passes=None, backend="ort", trt=None,
                            preset=None, trt_version=None, dtype=dtype, opset=opset)
            src = cached_engine(plain, progress=progress) / "model.onnx"
        else:
            export(loaded.model, tmp / "model.onnx", dtype=dtype, opset=opset)
        if steps:
            stage("graph passes")
            report = _run_passes(config, steps, src, tmp / "model.onnx", loaded.tokenizer, progress)
        stage("tokenizer")
        loaded.tokenizer.save_pretrained(tmp / "tokenizer")
        backend = {"name": "onnxruntime", "version": ort.__version__}
        if trt:
            stage("TensorRT engine")
            from enginesmith.build import jetson, trt as trt_build

            target = config.trt_version or (jetson.preset(config.preset).lint_target() if config.preset else None)
            backend = trt_build.build_tensorrt(tmp, config.trt or trt_build.trt_config(config.preset), target)
            backend.setdefault("version", trt_version)
        stage("hashes + build.json")
        cfg = loaded.model.config
        shape = KVShape.of(cfg)
        eos = cfg.eos_token_id
        engine_dir.write_manifest(tmp, {
            "enginesmith_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "source": {"kind": source.kind, "path": source.path, "name": source.name, "sha256": source.sha256},
            "model": {
                "family": loaded.family.name, "architecture": loaded.family.architecture,
                "layers": shape.layers, "heads": shape.heads, "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim, "vocab": shape.vocab, "max_positions": shape.max_positions,
                "eos_token_ids": sorted(set(eos if isinstance(eos, list) else [eos] if eos is not None else [])),
                "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id,
            },
            "graph": "model.onnx",
            "precision": dtype + (f"+{config.quant}" if config.quant else ""),
            "opset": opset if config.kv_layout == "dense" else max(opset, 24),
            "passes": [step.spec() for step in steps],
            "pass_report": [{k: e[k] for k in ("name", "params", "exact", "counts", "max_diff", "seconds")}
                            for e in report],
            "calibration": _calibration_note(config, steps),
            "kv_layout": kv_layout,
            "backend": backend,
            "exporter": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "build_seconds": round(time.time() - started, 1),
        })
    return out


def pipeline(config: BuildConfig) -> list:
    """The pass steps of a build: quantization preset and/or explicit passes, the KV layout, the
    backend lowering (empty for a plain dense engine)."""
    if not (config.quant or config.passes or config.kv_layout != "dense"):
        return []
    from enginesmith.passes import build_pipeline, make_step

    steps = build_pipeline(quant=config.quant, passes_text=config.passes, block_size=config.block_size,
                           alpha=config.alpha, backend=config.backend, accuracy_level=config.accuracy_level)
    if config.kv_layout == "ring":
        ring = make_step("kv_ring", {"sinks": str(config.kv_sinks), "window": str(config.kv_window)})
        at = next((i for i, s in enumerate(steps) if s.name.startswith("lower_")), len(steps))
        steps.insert(at, ring)
    if config.kv_layout == "paged":  # the CPU lowering is a decomposed reference; TensorRT gets the plugin
        paged = make_step("kv_paged", {"page_size": str(config.page_size),
                                       "lower": "trt" if config.backend == "trt" else "cpu"})
        at = next((i for i, s in enumerate(steps) if s.name.startswith("lower_")), len(steps))
        steps.insert(at, paged)
    return steps


def _run_passes(config: BuildConfig, steps: list, src: Path, dst: Path, tokenizer, progress: bool) -> list[dict]:
    from enginesmith.passes import calibration_set, run_pipeline
    from enginesmith.passes.machinery.registry import calibrated_steps

    calibration = None
    if calibrated_steps(steps):
        calibration = calibration_set(tokenizer, config.calib_text, samples=config.calib_samples)
    return run_pipeline(src, dst, steps, calibration=calibration, progress=progress)


def _calibration_note(config: BuildConfig, steps: list) -> dict | None:
    from enginesmith.passes.analysis.calibrate import DEFAULT_NOVEL
    from enginesmith.passes.machinery.registry import calibrated_steps

    if not steps or not calibrated_steps(steps):
        return None
    return {"text": config.calib_text or f"austen:{DEFAULT_NOVEL}", "samples": config.calib_samples}


def _export_settings(config: BuildConfig) -> tuple[str, int]:
    """dtype and opset of the export: a Jetson preset fixes both (its TensorRT parses only those)."""
    if config.backend == "trt" and config.preset:
        from enginesmith.build import jetson

        p = jetson.preset(config.preset)
        return p.dtype, p.opset
    return config.dtype, config.opset


def _check_tensorrt(config: BuildConfig) -> str:
    from enginesmith.build import trt as trt_build

    return trt_build.check_ready(config.preset)


def _kv_layout(config: BuildConfig, max_positions: int) -> dict:
    """build.json's kv_layout, after checking the ring fits the model's context."""
    if config.kv_layout == "dense":
        return {"type": "dense", "capacity": max_positions}
    if config.kv_layout == "paged":
        if config.page_size not in (16, 32, 64) and config.backend == "trt":
            raise UserError(f"page size {config.page_size} is not one the PagedAttention plugin supports",
                            "use --page-size 16, 32 or 64")
        return {"type": "paged", "page_size": config.page_size, "capacity": max_positions}
    capacity = config.kv_sinks + config.kv_window
    if capacity > max_positions:
        raise UserError(f"a ring KV cache of {config.kv_sinks} sinks + {config.kv_window} window = {capacity} "
                        f"slots exceeds the model's context of {max_positions} positions",
                        f"use --sinks + --kv-window <= {max_positions}")
    return {"type": "ring", "sinks": config.kv_sinks, "window": config.kv_window, "capacity": capacity}


def default_engine_path(config: BuildConfig) -> Path:
    from enginesmith.models import load as models

    source = models.resolve(config.model)
    return cache_dir() / "engines" / config.key(source.sha256)


def cached_engine(config: BuildConfig, progress: bool = True) -> Path:
    """The engine for `config` from the cache, building it first if it is not there yet."""
    path = default_engine_path(config)
    if _cached_usable(path, notice=False):
        return path
    with engine_dir.lock(path, wait=True):  # another process building the same engine: wait for it
        if _cached_usable(path, notice=True):
            return path
        print(f"Building the engine for {config.model or 'the default model (SmolLM2-135M-Instruct)'} "
              f"once; it is cached in {path}")
        build(config, path, force=True, progress=progress, locked=True, replace_any=True)
    return path


def _cached_usable(path: Path, notice: bool) -> bool:
    """Whether the cached engine at `path` has a build.json this enginesmith reads; a stale or broken
    one is rebuilt (with a notice) by the caller. Its files are verified when it is opened."""
    if not os.path.lexists(path):
        return False
    try:
        engine_dir.read_manifest(path)
        return True
    except UserError as exc:
        if notice:
            print(f"notice: the cached engine {path} is unusable ({exc.what}); rebuilding it", file=sys.stderr)
        return False


GQA_IO = "gqa-shared-buffer"


def lower_for_cuda(src: Path, out: Path, capacity: int | None = None, quant: str | None = None,
                   block_size: int = 128, quantize_lm_head: bool = False, force: bool = False,
                   progress: bool = True, custom_ops: bool | None = None, custom_attention: bool = False,
                   max_batch: int | None = None) -> Path:
    """From an engine built by `build`, an engine for runtime.ort_cuda.GqaEngine (ORT CUDA's fast
    decode path): GroupQueryAttention on shared KV buffers (lower_gqa), fused residual norms
    (skip_rmsnorm), with quant="w4a16" int4 weights as MatMulNBits (the lm_head too with
    quantize_lm_head, after untie_lm_head gives a tied one its own matrix), and the remaining fp16
    MatMuls as FusedMatMul(transB) on [N, K] weights (matmul_transb: a tied lm_head then reads the
    embedding table instead of a transposed copy ORT would fold at load). build.json records the
    passes and kv_layout.io = "gqa-shared-buffer" (open it with runtime.ort_cuda.open_gqa_engine).
    custom_ops: the decode GEMVs as enginesmith's ORT custom ops (passes/ort_gemv.py; the engine then
    needs libenginesmith_ort_ops.so at run time). None: when that library is built; True: required.
    custom_attention (with the ops): the attention too (passes/ort_attention.py): faster decode steps at
    short contexts, but prompts run 2-13x slower than ORT's flash attention (plugins/README.md).
    max_batch: recorded as kv_layout.max_batch, the KV rows the CLI opens the engine with."""
    import shutil

    import enginesmith.passes.lower.lower_gqa  # noqa: F401  (registers the passes)
    import enginesmith.passes.fusion.matmul_transb  # noqa: F401
    import enginesmith.passes.lower.ort_attention  # noqa: F401
    import enginesmith.passes.lower.ort_gemv  # noqa: F401
    import enginesmith.passes.fusion.skip_rmsnorm  # noqa: F401
    import enginesmith.passes.fusion.untie_lm_head  # noqa: F401
    from enginesmith.passes import parse_pipeline, run_pipeline

    src, out = Path(src), Path(out)
    manifest = engine_dir.verify(src, onnx_graph=True)
    if manifest.kv_layout.io == GQA_IO:
        raise UserError(f"{src} is already lowered for CUDA", "lower the engine it was built from")
    capacity = capacity or manifest.model.max_positions
    steps = f"lower_gqa:capacity={capacity},skip_rmsnorm"
    if quant == "w4a16":
        lm_head = ",untie_lm_head" if quantize_lm_head else ""
        steps += f"{lm_head},quantize_w4a16:block_size={block_size}:include_lm_head={quantize_lm_head},lower_ort"
    elif quant:
        raise UserError(f"unknown quantization {quant!r} for the CUDA engine", "use w4a16 or none")
    steps += ",matmul_transb"  # remaining fp16 MatMuls on [N, K] weights: a tied lm_head needs no copy
    from enginesmith.plugins import ort_ops

    if custom_ops:
        ort_ops.require()
    if custom_ops or (custom_ops is None and ort_ops.available()):
        steps += ",ort_gemv" + (",ort_attention" if custom_attention else "")
    with engine_dir.write_atomically(out, overwrite=force) as tmp:
        # The output check's tolerance is fp32's; fp16 norms legitimately differ by rounding there.
        report = run_pipeline(src / manifest.graph, tmp / "model.onnx", steps, progress=progress,
                              verify_exact=manifest.precision == "fp32")
        shutil.copytree(src / "tokenizer", tmp / "tokenizer")
        lowered = {k: v for k, v in manifest.raw.items() if k not in ("files", "created", "format_version")}
        lowered.update(
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), graph="model.onnx",
            passes=list(manifest.passes) + [step.spec() for step in parse_pipeline(steps)],
            pass_counts={e["name"]: e["counts"] for e in report},
            kv_layout={"type": "dense", "io": GQA_IO, "capacity": capacity,
                       **({"max_batch": max_batch} if max_batch else {})},  # KV rows the runtime allocates
            lowered_from=str(src))
        if quant:
            lowered["precision"] = f"{manifest.precision}+{quant}"
        engine_dir.write_manifest(tmp, lowered)
    return out
