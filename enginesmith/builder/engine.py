"""`enginesmith build`: model source -> export -> passes -> engine directory (atomically).

The default engine (embedded SmolLM2, fp32, ORT) is built on first use by `run`/`chat` and cached
under the cache dir, keyed by the source's hash and the build settings.
"""

from __future__ import annotations

import platform
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from enginesmith import __version__
from enginesmith.builder import cache, jetson
from enginesmith.builder.cache import default_engine_path  # noqa: F401  (re-exported)
from enginesmith.builder.config import (KV_DTYPES, KV_LAYOUTS, PAGE_SIZE, PAGED_MAX_BATCH,  # noqa: F401  (re-exported)
                                      TARGETS, BuildConfig)
from enginesmith.builder.code_fingerprint import code_fingerprint
from enginesmith.core import engine_dir, kv_spec
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

    # deferred: torch and transformers (through export) load only when an export runs, not on a cache hit
    import torch
    import transformers

    from enginesmith.export.kv_io import KVShape  # deferred: imports torch
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
        kv_layout = _kv_layout(config, KVShape.of(loaded.model.config).max_positions)
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
        cfg = loaded.model.config
        shape = KVShape.of(cfg)
        eos = cfg.eos_token_id
        engine_dir.write_manifest(tmp, {
            "enginesmith_version": __version__,
            "builder_code": code_fingerprint(),
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
            **({"lora": {"path": adapter.path, "sha256": adapter.sha256, "modules": len(adapter.updates)}}
               if adapter is not None else {}),
            "precision": dtype + (f"+{config.quant}" if config.quant else ""),
            "opset": opset if config.kv_layout == "dense" else max(opset, 24),
            "passes": [step.spec() for step in pass_steps],
            "pass_report": [{k: e[k] for k in ("name", "params", "exact", "counts", "max_diff", "seconds")}
                            for e in report],
            "calibration": _calibration_note(config, pass_steps),
            "kv_layout": kv_layout,
            "backend": backend,
            "exporter": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "python": platform.python_version()},
            "build_seconds": round(time.time() - started, 1),
        })
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


def steps(config: BuildConfig, max_positions: int | None = None, unfused_attention: bool = False) -> list:
    """The pass steps of a build, in order: quantization preset and/or explicit passes, the KV layout,
    the lowering for the target (empty for a plain dense ort-cpu or trt engine). An ort-cuda build's
    KV capacity is config.capacity, else `max_positions` (the model's context); `unfused_attention`:
    its source graph has no Attention op (Gemma 2's soft-capping is exported eagerly), fused first."""
    from enginesmith.passes import build_pipeline, make_step, parse_pipeline  # deferred: imports onnx, onnxruntime

    if config.target == "ort-cuda":
        if not (config.capacity or max_positions):
            raise ValueError("an ort-cuda pipeline needs the KV capacity (config.capacity or max_positions)")
        return parse_pipeline(_cuda_pipeline(config, config.capacity or max_positions, unfused_attention))
    if not (config.quant or config.passes or config.kv_layout != "dense"):
        return []
    pass_steps = build_pipeline(quant=config.quant, passes_text=config.passes, block_size=config.block_size,
                                alpha=config.alpha, backend=config.backend, accuracy_level=config.accuracy_level)
    if config.kv_layout == "ring":
        ring = make_step("kv_ring", {"sinks": str(config.kv_sinks), "window": str(config.kv_window)})
        at = next((i for i, s in enumerate(pass_steps) if s.name.startswith("lower_")), len(pass_steps))
        pass_steps.insert(at, ring)
    if config.kv_layout == "h2o":  # a ring of no sinks whose attention scores drive the evictions
        at = next((i for i, s in enumerate(pass_steps) if s.name.startswith("lower_")), len(pass_steps))
        pass_steps[at:at] = [make_step("kv_ring", {"sinks": "0", "window": str(config.kv_budget)}), make_step("kv_h2o")]
    if config.kv_layout == "paged":  # the CPU lowering is a decomposed reference; TensorRT gets the plugin
        paged = make_step("kv_paged", {"page_size": str(config.page_size),
                                       "lower": "trt" if config.target == "trt" else "cpu"})
        at = next((i for i, s in enumerate(pass_steps) if s.name.startswith("lower_")), len(pass_steps))
        pass_steps.insert(at, paged)
    return pass_steps


def _cuda_pipeline(config: BuildConfig, capacity: int, unfused_attention: bool = False) -> str:
    """ort-cuda: an eager-exported attention as the Attention op first (fuse_attention, only when
    `unfused_attention`), GroupQueryAttention on shared KV buffers (lower_gqa), fused residual norms
    (skip_rmsnorm), with w4a16-rtn int4 weights as MatMulNBits (the lm_head too with quantize_lm_head,
    after untie_lm_head gives a tied one its own matrix), and the remaining fp16 MatMuls as
    FusedMatMul(transB) on [N, K] weights (matmul_transb: a tied lm_head then reads the embedding table
    instead of a transposed copy ORT would fold at load); with the custom ops, the decode GEMVs
    (ort_gemv) and optionally the attention (ort_attention) as enginesmith's ORT ops. A paged engine
    has them all and ends with paged_gqa (the attention over page pools). A dense engine with a quantized
    kv_dtype ends with quantize_kv (its attention op's KV buffers as codes)."""
    text = ("fuse_attention," if unfused_attention else "") + f"lower_gqa:capacity={capacity},skip_rmsnorm"
    if config.quant == "w4a16-rtn":
        lm_head = ",untie_lm_head" if config.quantize_lm_head else ""
        text += (f"{lm_head},quantize_w4a16:block_size={config.block_size}:include_lm_head={config.quantize_lm_head}"
                 ",lower_ort")
    text += ",matmul_transb"  # remaining fp16 MatMuls on [N, K] weights: a tied lm_head needs no copy
    if config.kv_layout == "paged":
        kv_dtype = f":kv_dtype={config.kv_dtype}" if config.kv_dtype != "fp16" else ""
        return text + f",ort_gemv,ort_attention,paged_gqa:page_size={config.page_size}{kv_dtype}"
    if config.custom_ops or config.custom_attention or (config.custom_ops is None and ort_ops.available()):
        text += ",ort_gemv" + (",ort_attention" if config.custom_attention else "")
    if config.kv_dtype != "fp16":  # dense, with custom_attention (validate): the op's KV buffers quantized
        text += f",quantize_kv:kv_dtype={config.kv_dtype}"
    return text


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
    pass_steps = steps(config, capacity, _unfused_attention(src / manifest.graph))
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
    lowered = {k: v for k, v in manifest.raw.items() if k not in ("files", "created", "format_version")}
    lowered.update(
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), graph="model.onnx",
        builder_code=code_fingerprint(),
        passes=list(manifest.passes) + [step.spec() for step in pass_steps],
        pass_counts={e["name"]: e["counts"] for e in report},
        kv_layout=_cuda_kv_layout(config, capacity), lowered_from=str(src))
    if config.quant:
        lowered["precision"] = f"{manifest.precision}+w4a16"  # the name before the -rtn preset
    engine_dir.write_manifest(tmp, lowered)


def _unfused_attention(graph: Path) -> bool:
    """Whether an exported graph has no Attention op (its attention is MatMul ... Softmax ... MatMul)."""
    import onnx  # deferred: imports protobuf; the weights stay on disk (external data)

    return not any(n.op_type == "Attention" for n in onnx.load(str(graph), load_external_data=False).graph.node)


def _cuda_kv_layout(config: BuildConfig, capacity: int) -> dict:
    """build.json's kv_layout of an ort-cuda engine: dense (max_batch: KV rows the runtime allocates,
    each of the full capacity) or paged (max_batch: most rows per step; pages are the runtime's choice)."""
    if config.kv_layout == "paged":
        return {"type": "paged", "io": PAGED_GQA_IO, "page_size": config.page_size, "capacity": capacity,
                "max_batch": config.max_batch or PAGED_MAX_BATCH,
                **({"kv_dtype": config.kv_dtype} if config.kv_dtype != "fp16" else {})}
    return {"type": "dense", "io": GQA_IO, "capacity": capacity,
            **({"max_batch": config.max_batch} if config.max_batch else {}),
            **({"kv_dtype": config.kv_dtype} if config.kv_dtype != "fp16" else {})}


def _run_passes(config: BuildConfig, pass_steps: list, src: Path, dst: Path, tokenizer, progress: bool) -> list[dict]:
    from enginesmith.passes import calibration_set, run_pipeline  # deferred: imports onnx, onnxruntime
    from enginesmith.passes.manager.steps import calibrated_steps  # deferred: imports onnx

    calibration = None
    if calibrated_steps(pass_steps):
        calibration = calibration_set(tokenizer, config.calib_text, samples=config.calib_samples)
    return run_pipeline(src, dst, pass_steps, calibration=calibration, progress=progress)


def _calibration_note(config: BuildConfig, pass_steps: list) -> dict | None:
    from enginesmith.passes.analysis.calibrate import DEFAULT_NOVEL  # deferred: imports onnx
    from enginesmith.passes.manager.steps import calibrated_steps  # deferred: imports onnx

    if not pass_steps or not calibrated_steps(pass_steps):
        return None
    return {"text": config.calib_text or f"austen:{DEFAULT_NOVEL}", "samples": config.calib_samples}


def _export_settings(config: BuildConfig) -> tuple[str, int]:
    """dtype and opset of the export: a Jetson preset fixes both (its TensorRT parses only those)."""
    if config.target == "trt" and config.preset:
        p = jetson.preset(config.preset)
        return p.dtype, p.opset
    return config.dtype, config.opset


def _check_tensorrt(config: BuildConfig) -> str:
    from enginesmith.builder import trt as trt_build  # deferred: trt_lint imports onnx

    return trt_build.check_ready(config.preset)


def _kv_layout(config: BuildConfig, max_positions: int) -> dict:
    """build.json's kv_layout, after checking the ring fits the model's context."""
    if config.kv_layout == "dense":
        return {"type": "dense", "capacity": max_positions}
    if config.kv_layout == "paged":
        if config.page_size not in (16, 32, 64) and config.target == "trt":
            raise UserError(f"page size {config.page_size} is not one the PagedAttention plugin supports",
                            "use --page-size 16, 32 or 64")
        return {"type": "paged", "page_size": config.page_size, "capacity": max_positions}
    if config.kv_layout == "h2o":
        if config.kv_budget > max_positions:
            raise UserError(f"an H2O cache of {config.kv_budget} slots exceeds the model's context of "
                            f"{max_positions} positions", f"use --kv-budget <= {max_positions}")
        kind, policy = kv_spec.stored_layout("h2o")
        return {"type": kind, "policy": policy, "sinks": 0, "window": config.kv_budget, "capacity": config.kv_budget}
    capacity = config.kv_sinks + config.kv_window
    if capacity > max_positions:
        raise UserError(f"a ring KV cache of {config.kv_sinks} sinks + {config.kv_window} window = {capacity} "
                        f"slots exceeds the model's context of {max_positions} positions",
                        f"use --sinks + --kv-window <= {max_positions}")
    return {"type": "ring", "sinks": config.kv_sinks, "window": config.kv_window, "capacity": capacity}
