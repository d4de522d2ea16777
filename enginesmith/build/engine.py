"""`enginesmith build`: model source -> export -> passes -> engine directory (atomically).

The default engine (embedded SmolLM2, fp32, ORT) is built on first use by `run`/`chat` and cached
under the cache dir, keyed by the source's hash and the build settings.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from enginesmith import __version__
from enginesmith.build import jetson
from enginesmith.build.code_fingerprint import code_fingerprint
from enginesmith.core import engine_dir
from enginesmith.core.errors import UserError
from enginesmith.core.onnxruntime_flavour import require as require_onnxruntime
from enginesmith.core.io_names import GQA_IO, MAX_CUDA_BATCH, PAGED_GQA_IO
from enginesmith.core.paths import cache_dir
from enginesmith.models import load as models
from enginesmith.models import lora_adapter
from enginesmith.plugins import ort_ops
from enginesmith.plugins.limits import limits as kernel_limits

TARGETS = ("ort-cpu", "ort-cuda", "trt")
KV_LAYOUTS = ("dense", "ring", "paged", "h2o")
# --for-cuda: the KV format of the paged engine's pages (passes/lower/ort_paged_gqa.py) or of the dense
# engine's buffers with --custom-attention (passes/lower/ort_kv_quant.py)
KV_DTYPES = ("fp16", "int8", "fp8")
PAGE_SIZE = 16                 # "paged" default: tokens per KV page
PAGED_MAX_BATCH = 64           # ort-cuda paged: default most rows per step (kv_layout.max_batch)
# fields added after the first cache keys: in a key only when they differ from the default
_LATER_FIELDS = ("page_size", "accuracy_level", "quant", "block_size", "alpha", "calib_text", "calib_samples", "trt", "preset",
                 "trt_version", "capacity", "max_batch", "quantize_lm_head", "custom_ops", "custom_attention", "lora",
                 "kv_budget", "kv_dtype")
_CUDA_FIELDS = ("capacity", "max_batch", "quantize_lm_head", "custom_ops", "custom_attention")


@dataclass(frozen=True)
class BuildConfig:
    """What to build: the model, the target, and the passes; validated once, here (`validate`).

    target "ort-cpu": ONNX Runtime (CPU, or CUDA through the plain graph); "ort-cuda": ORT CUDA's
    fast decode path (runtime.ort_cuda.GqaEngine: GroupQueryAttention on shared KV buffers, fp16/bf16),
    or with kv_layout "paged" the in-flight batching engine (PagedGroupQueryAttention on page pools: fp16,
    enginesmith's ORT ops); "trt": a TensorRT plan (build/trt.py)."""
    model: str | None = None     # see models.load.resolve
    lora: str | None = None      # a PEFT LoRA adapter directory, folded into the weights at export
    target: str = "ort-cpu"      # "ort-cpu" | "ort-cuda" | "trt"
    dtype: str = "fp32"
    opset: int = 23
    kv_layout: str = "dense"     # "ring": StreamingLLM cache of kv_sinks + kv_window slots
    kv_sinks: int = 4
    kv_window: int = 1020
    kv_budget: int = 1024        # "h2o": KV slots (heavy hitters + recent tokens), a ring graph of no sinks
    page_size: int = PAGE_SIZE   # "paged": tokens per KV page (block)
    kv_dtype: str = "fp16"       # ort-cuda paged, or dense with custom_attention: the KV format, fp16 or int8 /
                                 # fp8 codes (calibrated scales)
    # graph passes (enginesmith.passes): a preset and/or an explicit pipeline, then the lowering
    quant: str | None = None     # a passes.PRESETS name, e.g. w4a16-awq, w4a16-gptq (ort-cuda: w4a16-rtn)
    passes: str | None = None    # e.g. "smoothquant:alpha=0.6,quantize_w8a8"
    block_size: int = 128        # W4A16 block along K
    alpha: float | None = None   # SmoothQuant strength; None = searched per layer
    calib_text: str | None = None  # calibration text file (default: the Austen corpus)
    calib_samples: int = 32
    accuracy_level: int = 0      # ORT MatMulNBits: 0 = fp activations, 4 = int8 activations (faster on CPU)
    # ort-cuda: KV positions (None = the model's context), KV rows the runtime allocates (recorded as
    # kv_layout.max_batch; paged: most rows per step, default PAGED_MAX_BATCH), the lm_head int4 too,
    # the decode GEMVs (and the attention) as enginesmith's ORT custom ops (None: when
    # libenginesmith_ort_ops.so is built, always for paged; True: required)
    capacity: int | None = None
    max_batch: int | None = None
    quantize_lm_head: bool = False
    custom_ops: bool | None = None
    custom_attention: bool = False
    # trt: a build.trt_plan.TrtBuildConfig, a Jetson preset, a lint target
    trt: object | None = None
    preset: str | None = None
    trt_version: str | None = None

    def __post_init__(self):
        self.validate()

    @property
    def needs_ort_ops(self) -> bool:
        """Whether an ort-cuda engine must have enginesmith's ORT ops (asked for, or the paged attention)."""
        return self.target == "ort-cuda" and bool(self.custom_ops or self.custom_attention or self.kv_layout == "paged")

    @property
    def backend(self) -> str:
        """The runtime family: "trt", else "ort" (the passes' lowering and the cache keys use it)."""
        return "trt" if self.target == "trt" else "ort"

    def validate(self) -> None:
        """Refuse a combination the target does not build, naming what it supports (flags as the CLI spells them)."""
        if self.target not in TARGETS:
            raise UserError(f"unknown target {self.target!r}", f"use one of: {', '.join(TARGETS)}")
        if self.kv_layout not in KV_LAYOUTS:
            raise UserError(f"unknown KV layout {self.kv_layout!r}", f"use one of: {', '.join(KV_LAYOUTS)}")
        if self.kv_layout == "ring" and (self.kv_sinks < 0 or self.kv_window < 1):
            raise UserError(f"a ring KV cache needs sinks >= 0 and a window >= 1 (got --sinks {self.kv_sinks}, "
                            f"--kv-window {self.kv_window})", "e.g. --sinks 4 --kv-window 1020")
        if self.kv_layout == "h2o" and self.kv_budget < 8:
            raise UserError(f"--kv-budget {self.kv_budget} is too small for an H2O cache",
                            "use --kv-budget 8 or more (e.g. 20 % of the stream's length)")
        if self.page_size < 1:
            raise UserError(f"--page-size {self.page_size} is not a positive number of tokens", "use e.g. --page-size 16")
        if self.kv_dtype not in KV_DTYPES:
            raise UserError(f"unknown KV page format --kv-dtype {self.kv_dtype}", f"use one of: {', '.join(KV_DTYPES)}")
        if self.kv_dtype != "fp16" and self.target != "ort-cuda":
            raise UserError(f"--kv-dtype {self.kv_dtype} quantizes the pages of the CUDA paged engine or the KV "
                            "buffers of a dense --for-cuda --custom-attention engine",
                            "add --for-cuda with --kv paged or --custom-attention, or drop --kv-dtype")
        if self.target == "ort-cuda":
            self._validate_cuda()
            return
        if self.preset is not None and self.target != "trt":
            raise UserError("--preset is a TensorRT (Jetson) preset", "add --backend trt")
        only_cuda = [flag for flag, given in (("--max-batch", self.max_batch is not None),
                                              ("--quantize-lm-head", self.quantize_lm_head),
                                              ("--custom-ops", self.custom_ops is not None),
                                              ("--custom-attention", self.custom_attention),
                                              ("--capacity", self.capacity is not None)) if given]
        if only_cuda:
            raise UserError(f"{' and '.join(only_cuda)} belong{'s' * (len(only_cuda) == 1)} to --for-cuda engines",
                            "add --for-cuda" + (" (a TensorRT build takes --trt-max-batch)"
                                                if self.max_batch is not None else ""))

    def _validate_cuda(self) -> None:
        refuse = [(self.kv_layout in ("ring", "h2o"), f"--kv {self.kv_layout}"), (self.passes is not None, "--passes"),
                  (self.preset is not None, "--preset"), (self.trt is not None, "--backend trt"),
                  (self.trt_version is not None, "--trt-version"),
                  (self.quant not in (None, "w4a16-rtn"), f"--quant {self.quant}"),
                  (self.dtype == "fp32", "--dtype fp32 (GroupQueryAttention on CUDA is fp16/bf16)")]
        bad = [what for cond, what in refuse if cond]
        if bad:
            raise UserError(f"--for-cuda does not combine with {', '.join(bad)}",
                            "use --for-cuda with --dtype fp16 or bf16 and, for int4 weights, --quant w4a16-rtn")
        if self.quantize_lm_head and self.quant != "w4a16-rtn":
            raise UserError("--quantize-lm-head makes the lm_head int4 and needs --quant w4a16-rtn",
                            "add --quant w4a16-rtn, or drop --quantize-lm-head")
        if self.max_batch is not None and not 1 <= self.max_batch <= MAX_CUDA_BATCH:
            raise UserError(f"--max-batch {self.max_batch} is outside 1..{MAX_CUDA_BATCH}",
                            "use the most sequences you will run at once" + (
                                " in one step" if self.kv_layout == "paged" else " (each holds a full-capacity KV row)"))
        if self.capacity is not None and self.capacity < 1:
            raise UserError(f"KV capacity {self.capacity} is not a positive number of positions", "e.g. 2048")
        if self.custom_attention and self.custom_ops is False:
            raise UserError("--custom-attention needs the custom ops", "drop --custom-ops off")
        if self.kv_layout == "paged":
            self._validate_cuda_paged()
        elif self.kv_dtype != "fp16":
            self._validate_cuda_dense_kv()

    def _validate_cuda_dense_kv(self) -> None:
        """A dense engine's quantized KV is read by enginesmith's attention op alone (fp16 activations)."""
        if not self.custom_attention:
            raise UserError(f"--kv-dtype {self.kv_dtype} on a dense --for-cuda engine needs --custom-attention: "
                            "ONNX Runtime's own GroupQueryAttention reads fp16 KV only",
                            "add --custom-attention (or --kv paged), or drop --kv-dtype")
        if self.dtype != "fp16":
            raise UserError(f"--kv-dtype {self.kv_dtype} is read by enginesmith's attention op, which is fp16 "
                            f"(got --dtype {self.dtype})", "use --dtype fp16, or drop --kv-dtype")

    def _validate_cuda_paged(self) -> None:
        if self.dtype != "fp16":
            raise UserError(f"--for-cuda --kv paged runs enginesmith's paged attention op, which is fp16 "
                            f"(got --dtype {self.dtype})", "use --dtype fp16, or drop --kv paged for a dense engine")
        if self.custom_ops is False:
            raise UserError("--for-cuda --kv paged needs the custom ops (its attention is enginesmith's paged "
                            "attention op)", "drop --custom-ops off, or drop --kv paged for a dense engine")
        sizes = kernel_limits()["paged_attention"]["block_sizes"]  # the op's kernels' (plugins/limits.json)
        if self.page_size not in sizes:
            raise UserError(f"--page-size {self.page_size} is not one the paged attention op takes",
                            f"use --page-size {', '.join(map(str, sizes))}")

    def key(self, source_sha: str) -> str:
        """Cache key of the engine this config builds from a source."""
        fields_ = {k: v for k, v in asdict(self).items() if k not in ("model", "target")}
        fields_["backend"] = self.backend  # the keys from before targets: "ort" | "trt"
        if self.target == "ort-cuda":
            fields_["target"] = self.target
        if self.kv_layout == "dense":  # dense engines keep the keys they had before the kv_ options (but a
            # quantized KV format, --for-cuda --custom-attention, names its engine)
            fields_ = {k: v for k, v in fields_.items() if not k.startswith("kv_") or (k == "kv_dtype" and v != "fp16")}
        # plain engines keep the keys they had before the pass, TensorRT and CUDA options
        plain = asdict(BuildConfig())
        fields_ = {k: v for k, v in fields_.items() if k not in _LATER_FIELDS or v != plain[k]}
        fields_["passes"] = fields_.get("passes") or []
        if self.lora:  # the adapter's content, not its path, names the engine
            fields_["lora"] = lora_adapter.resolve(self.lora)[1]
        settings = json.dumps(fields_, sort_keys=True)
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
    ort = require_onnxruntime()  # missing or mixed ONNX Runtime: one line before minutes of export
    trt_version = _check_tensorrt(config) if config.target == "trt" else None  # before minutes of export
    if config.needs_ort_ops:
        ort_ops.require()  # compiled here on first use, or a one-line reason why it cannot be
    if config.target == "ort-cuda":  # the plain engine (cached), lowered into `out`
        with engine_dir.write_atomically(
                out, overwrite=force, locked=locked,
                replaceable=(lambda _: True) if replace_any else engine_dir.looks_like_engine) as tmp:
            src = cached_engine(_plain_source(config, config.dtype, config.opset), progress=progress)
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
    with engine_dir.write_atomically(
            out, overwrite=force, locked=locked,
            replaceable=(lambda _: True) if replace_any else engine_dir.looks_like_engine) as tmp, _stages(names, progress) as stage:
        stage("load model")
        loaded = models.load(source)
        adapter = lora_adapter.read_adapter(config.lora) if config.lora else None
        if adapter is not None:
            fold_lora(loaded.model, adapter)
        kv_layout = _kv_layout(config, KVShape.of(loaded.model.config).max_positions)
        stage("export to ONNX")
        if pass_steps:  # passes start from the plain dense export, built once and cached
            src = cached_engine(_plain_source(config, dtype, opset), progress=progress) / "model.onnx"
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
            from enginesmith.build import trt as trt_build  # deferred: trt_lint imports onnx

            target = config.trt_version or (jetson.preset(config.preset).lint_target() if config.preset else None)
            backend = trt_build.build_tensorrt(tmp, config.trt or trt_build.trt_config(config.preset), target)
            backend.setdefault("version", trt_version)
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


def _plain_source(config: BuildConfig, dtype: str, opset: int) -> BuildConfig:
    """The plain dense engine a pass pipeline starts from (cached; an ort-cuda build lowers it)."""
    if config.target == "ort-cuda":
        return BuildConfig(model=config.model, lora=config.lora, dtype=dtype, opset=opset)
    return replace(config, target="ort-cpu", kv_layout="dense", quant=None, passes=None, trt=None,
                   preset=None, trt_version=None, dtype=dtype, opset=opset)


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
    from enginesmith.passes.machinery.registry import calibrated_steps  # deferred: imports onnx
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
    from enginesmith.passes.machinery.registry import calibrated_steps  # deferred: imports onnx

    calibration = None
    if calibrated_steps(pass_steps):
        calibration = calibration_set(tokenizer, config.calib_text, samples=config.calib_samples)
    return run_pipeline(src, dst, pass_steps, calibration=calibration, progress=progress)


def _calibration_note(config: BuildConfig, pass_steps: list) -> dict | None:
    from enginesmith.passes.analysis.calibrate import DEFAULT_NOVEL  # deferred: imports onnx
    from enginesmith.passes.machinery.registry import calibrated_steps  # deferred: imports onnx

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
    from enginesmith.build import trt as trt_build  # deferred: trt_lint imports onnx

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
        return {"type": "ring", "policy": "h2o", "sinks": 0, "window": config.kv_budget,
                "capacity": config.kv_budget}
    capacity = config.kv_sinks + config.kv_window
    if capacity > max_positions:
        raise UserError(f"a ring KV cache of {config.kv_sinks} sinks + {config.kv_window} window = {capacity} "
                        f"slots exceeds the model's context of {max_positions} positions",
                        f"use --sinks + --kv-window <= {max_positions}")
    return {"type": "ring", "sinks": config.kv_sinks, "window": config.kv_window, "capacity": capacity}


def default_engine_path(config: BuildConfig) -> Path:
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
    """Whether the cached engine at `path` has a build.json this enginesmith reads, written by this
    code (code_fingerprint); a stale or broken one is rebuilt (with a notice) by the caller. Its files
    are verified when it is opened."""
    if not os.path.lexists(path):
        return False
    try:
        built_by = engine_dir.read_manifest(path).raw.get("builder_code")
    except UserError as exc:
        if notice:
            print(f"notice: the cached engine {path} is unusable ({exc.what}); rebuilding it", file=sys.stderr)
        return False
    if built_by != code_fingerprint():
        if notice:
            print(f"notice: the cached engine {path} was built by other enginesmith code; rebuilding it",
                  file=sys.stderr)
        return False
    return True


def lower_for_cuda(src: Path, out: Path, capacity: int | None = None, quant: str | None = None,
                   block_size: int = 128, quantize_lm_head: bool = False, force: bool = False,
                   progress: bool = True, custom_ops: bool | None = None, custom_attention: bool = False,
                   max_batch: int | None = None, kv_layout: str = "dense", page_size: int = PAGE_SIZE,
                   kv_dtype: str = "fp16", calib_samples: int = 32) -> Path:
    """The ort-cuda lowering of an engine `src` already built (tests and benchmarks lower fp32 ones
    too, for the CPU EP): the steps of BuildConfig(target="ort-cuda", ...) into `out`. quant: "w4a16"
    (= w4a16-rtn) or None. kv_layout "paged" (an fp16 `src`): PagedGroupQueryAttention over pools of
    `page_size`-token pages of `kv_dtype` (fp16, or int8 / fp8 codes with scales calibrated on
    `calib_samples` windows of the default text); dense with custom_attention: `kv_dtype` is the KV
    buffers' format likewise. Open a dense result with runtime.ort_cuda.open_gqa_engine."""
    if quant not in (None, "w4a16"):
        raise UserError(f"unknown quantization {quant!r} for the CUDA engine", "use w4a16 or none")
    # dtype only picks an export, and there is none here: the lowered precision is the source's
    config = BuildConfig(target="ort-cuda", dtype="fp16", capacity=capacity, quant=quant and "w4a16-rtn",
                         block_size=block_size, quantize_lm_head=quantize_lm_head, max_batch=max_batch,
                         custom_ops=custom_ops, custom_attention=custom_attention, kv_layout=kv_layout,
                         page_size=page_size, kv_dtype=kv_dtype, calib_samples=calib_samples)
    with engine_dir.write_atomically(Path(out), overwrite=force) as tmp:
        _lower(Path(src), tmp, config, progress)
    return Path(out)
