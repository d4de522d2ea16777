"""`enginesmith build`: model source -> export -> passes -> engine directory (atomically).

The orchestration: the stages of a build and the engine cache's builds. The pass pipeline a build runs
is pipeline.py's (`steps`), what it records in build.json is manifest.py's.

The default engine (embedded SmolLM2, fp32, ORT) is built on first use by `run`/`chat` and cached
under the cache dir, keyed by the source's hash and the build settings.
"""

from __future__ import annotations

import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from enginesmith.builder import cache, jetson
from enginesmith.builder import manifest as build_json
from enginesmith.builder.cache import default_engine_path  # noqa: F401  (re-exported)
from enginesmith.builder.config import (KV_DTYPES, KV_LAYOUTS, PAGE_SIZE, PAGED_MAX_BATCH,  # noqa: F401  (re-exported)
                                      TARGETS, BuildConfig)
from enginesmith.builder.pipeline import steps, unfused_attention
from enginesmith.core import engine_dir
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import require as require_onnxruntime
from enginesmith.core.progress import LOG_INTERVAL, interactive
from enginesmith.core.progress import bar as progress_bar
from enginesmith.core.io_names import GQA_IO, MAX_CUDA_BATCH, PAGED_GQA_IO  # noqa: F401  (MAX_CUDA_BATCH re-exported)
from enginesmith.models import load as models
from enginesmith.models import lora_adapter
from enginesmith.plugins import ort_ops


@contextmanager
def _stages(names: list[str], enabled: bool = True):
    """A progress bar over build stages that keeps ticking (elapsed time) during long ones."""
    bar = progress_bar(total=len(names), desc="build", unit="stage", disable=not enabled,
                       bar_format="{desc}: {n_fmt}/{total_fmt} [{elapsed}]{postfix}", mininterval=0)
    stop = threading.Event()

    def tick():  # in a log: a line every LOG_INTERVAL s during a long stage
        while not stop.wait(1.0 if interactive() else LOG_INTERVAL):
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
          replace_any: bool = False, source: Path | None = None) -> Path:
    """Build an engine directory at `out`; nothing is left at `out` if this fails or is interrupted. Another
    build writing `out` meanwhile is refused (`locked`: the caller holds its lock). `force` replaces only an
    engine directory (`replace_any`: whatever is there, for our own cache). `source` (ort-cuda only): an
    engine directory to lower, of any precision, in place of config.model's cached plain engine."""
    if source is not None and config.target != "ort-cuda":
        raise UserError(f"only an ort-cuda build lowers an engine already built (this is {config.target})",
                        "build from the model instead")
    ort = require_onnxruntime()  # missing or mixed ONNX Runtime: one line before minutes of export
    trt_version = _check_tensorrt(config) if config.target == "trt" else None  # before minutes of export
    if config.needs_ort_ops:
        ort_ops.require()  # compiled here on first use, or a one-line reason why it cannot be
    replaceable = (lambda _: True) if replace_any else engine_dir.looks_like_engine
    if config.target == "ort-cuda":  # the plain engine (cached) or `source`, lowered into `out`
        with engine_dir.write_atomically(out, overwrite=force, locked=locked, replaceable=replaceable) as tmp:
            src = Path(source) if source is not None else _cached_source(
                _plain_source(config, config.dtype, config.opset), progress=progress)
            _lower(src, tmp, config, progress)
        return Path(out)

    from enginesmith.export.kv_io import KVShape  # deferred: imports torch (only when an export runs)
    from enginesmith.export.lora import fold_lora  # deferred: imports torch
    from enginesmith.export.to_onnx import export  # deferred: imports torch

    dtype, opset = _export_settings(config)
    pass_steps = steps(config)
    source = models.resolve(config.model)
    out = Path(out)
    started = time.time()
    report: list[dict] = []
    trt = config.target == "trt"
    names = ["load", "export"] + ["passes"] * bool(pass_steps) + ["tokenizer"] + ["tensorrt"] * trt + ["manifest"]
    with engine_dir.write_atomically(out, overwrite=force, locked=locked, replaceable=replaceable) as tmp, \
            _stages(names, progress) as stage:
        stage("load model")
        loaded = models.load(source)
        adapter = lora_adapter.read_adapter(config.lora) if config.lora else None
        if adapter is not None:
            fold_lora(loaded.model, adapter)
        kv_layout = build_json.kv_layout(config, KVShape.of(loaded.model.config).max_positions)
        stage("export to ONNX")
        if pass_steps:  # passes start from the plain dense export, built once and cached
            src = _cached_source(_plain_source(config, dtype, opset), progress=progress) / "model.onnx"
        else:
            export(loaded.model, tmp / "model.onnx", dtype=dtype, opset=opset)
        if pass_steps:
            stage("graph passes")
            report = _run_passes(config, pass_steps, src, tmp / "model.onnx", loaded.tokenizer, progress)
        stage("tokenizer")
        loaded.tokenizer.save_pretrained(tmp / "tokenizer")
        backend = {"name": "onnxruntime", "version": ort.__version__}
        if trt:
            stage("TensorRT engine")
            backend = _tensorrt_backend(config, tmp, trt_version)
        stage("hashes + build.json")
        engine_dir.write_manifest(tmp, build_json.built(
            config, source=source, loaded=loaded, adapter=adapter, dtype=dtype, opset=opset, pass_steps=pass_steps,
            report=report, kv_layout=kv_layout, backend=backend, started=started))
    return out


def cached_engine(config: BuildConfig, progress: bool = True, verify_hashes: bool = False) -> Path:
    """The engine for `config` from the cache, building it first if it is not there yet. With
    `verify_hashes` (a source whose bytes go into another engine) every file's sha256 is checked too."""
    path = cache.default_engine_path(config)
    if cache.usable(path, notice=False, hashes=verify_hashes):
        return path
    with engine_dir.lock(path, wait=True):  # another process building the same engine: wait for it
        if cache.usable(path, notice=True, hashes=verify_hashes):
            return path
        print(f"Building the engine for {config.model or 'the default model (SmolLM2-135M-Instruct)'} "
              f"once; it is cached in {path}")
        build(config, path, force=True, progress=progress, locked=True, replace_any=True)
    return path


def _cached_source(config: BuildConfig, progress: bool = True) -> Path:
    """The cached engine a pass build or a CUDA lowering reads its graph from, its hashes verified."""
    return cached_engine(config, progress=progress, verify_hashes=True)


def _tensorrt_backend(config: BuildConfig, tmp: Path, trt_version: str | None) -> dict:
    """The TensorRT plan of the engine in `tmp`, built; build.json's backend record of it."""
    from enginesmith.builder import trt as trt_build  # deferred: trt_lint imports onnx

    target = config.trt_version or (jetson.preset(config.preset).lint_target() if config.preset else None)
    backend = trt_build.build_tensorrt(tmp, config.trt or trt_build.trt_config(config.preset), target)
    backend.setdefault("version", trt_version)
    return backend


def _plain_source(config: BuildConfig, dtype: str, opset: int) -> BuildConfig:
    """The plain dense engine a pass pipeline starts from (cached; an ort-cuda build lowers it): only
    what changes the plain export, so builds that differ in passes, calibration or KV share it."""
    return BuildConfig(model=config.model, lora=config.lora, dtype=dtype, opset=opset)


def _lower(src: Path, tmp: Path, config: BuildConfig, progress: bool) -> None:
    """Write the ort-cuda engine lowered from the engine at `src` into `tmp`: the graph, the tokenizer
    and build.json (the source's, with the passes appended and kv_layout.io = GQA_IO, or PAGED_GQA_IO)."""
    from enginesmith.passes import calibration_set, run_pipeline  # deferred: imports onnx, onnxruntime
    from enginesmith.passes.manager.steps import calibrated_steps  # deferred: imports onnx
    from transformers import AutoTokenizer  # deferred: heavy, only to calibrate quantized KV pages

    manifest = engine_dir.verify(src, onnx_graph=True)
    if manifest.kv_layout.io in (GQA_IO, PAGED_GQA_IO):
        raise UserError(f"{src} is already lowered for CUDA", "lower the engine it was built from")
    capacity = config.capacity or manifest.model.max_positions
    pass_steps = steps(config, capacity, unfused_attention(src / manifest.graph))
    if config.needs_ort_ops:
        ort_ops.require()
    calibration = None  # quantized KV pages: their scales (paged_gqa's kv_dtype)
    if calibrated_steps(pass_steps):
        tokenizer = AutoTokenizer.from_pretrained(str(src / "tokenizer"))
        calibration = calibration_set(tokenizer, config.calib_text, samples=config.calib_samples)
    # The output check's tolerance is fp32's; fp16 norms legitimately differ by rounding there.
    report = run_pipeline(src / manifest.graph, tmp / "model.onnx", pass_steps, progress=progress,
                          verify_exact=manifest.precision == "fp32", calibration=calibration)
    shutil.copytree(src / "tokenizer", tmp / "tokenizer")
    engine_dir.write_manifest(tmp, build_json.lowered(manifest, config, pass_steps, report, capacity, src))


def _run_passes(config: BuildConfig, pass_steps: list, src: Path, dst: Path, tokenizer, progress: bool) -> list[dict]:
    from enginesmith.passes import calibration_set, run_pipeline  # deferred: imports onnx, onnxruntime
    from enginesmith.passes.manager.steps import calibrated_steps  # deferred: imports onnx

    calibration = None
    if calibrated_steps(pass_steps):
        calibration = calibration_set(tokenizer, config.calib_text, samples=config.calib_samples)
    return run_pipeline(src, dst, pass_steps, calibration=calibration, progress=progress)


def _export_settings(config: BuildConfig) -> tuple[str, int]:
    """dtype and opset of the export: a Jetson preset fixes both (its TensorRT parses only those)."""
    if config.target == "trt" and config.preset:
        p = jetson.preset(config.preset)
        return p.dtype, p.opset
    return config.dtype, config.opset


def _check_tensorrt(config: BuildConfig) -> str:
    from enginesmith.builder import trt as trt_build  # deferred: trt_lint imports onnx

    return trt_build.check_ready(config.preset)
