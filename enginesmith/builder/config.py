"""What to build (`BuildConfig`: model, target, passes, KV layout), validated once, and the key that
names its engine in the cache.

    key = <source sha256[:16]>-<sha256(settings that change the engine + version)[:12]>

A key holds only the settings that change what is built (`key_fields`): the calibration text, its
sample count, a page size, ring sizes or quantization knobs count only where a step reads them, so
`--calib-samples 5` and `--calib-samples 9` share one plain engine (issue 28: 14 byte-identical
copies of one engine, each a fresh build).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

from enginesmith import __version__
from enginesmith.core.errors import UserError
from enginesmith.core import kv_spec
from enginesmith.core.io_names import MAX_CUDA_BATCH
from enginesmith.models import lora_adapter
from enginesmith.plugins.limits import limits as kernel_limits

TARGETS = ("ort-cpu", "ort-cuda", "trt")
# the KV layouts (a --kv choice), the CUDA KV formats (--for-cuda: the paged engine's pages, passes/kv/
# ort_paged_gqa.py, or the dense engine's buffers with --custom-attention, passes/kv/ort_kv_quant.py) and
# the default page size are named once, in core/kv_spec.py
KV_LAYOUTS, KV_DTYPES, PAGE_SIZE = kv_spec.BUILD_CHOICES, kv_spec.KV_DTYPES, kv_spec.PAGE_SIZE
PAGED_MAX_BATCH = 64           # ort-cuda paged: default most rows per step (kv_layout.max_batch)


@dataclass(frozen=True)
class BuildConfig:
    """What to build: the model, the target, and the passes; validated once, here (`validate`).

    target "ort-cpu": ONNX Runtime (CPU, or CUDA through the plain graph); "ort-cuda": ORT CUDA's
    fast decode path (runtime.engines.ort_cuda.GqaEngine: GroupQueryAttention on shared KV buffers, fp16/bf16),
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
        if self.kv_layout == "paged" and self.target == "trt":
            sizes = kernel_limits()["paged_attention"]["block_sizes"]  # the plugin's kernels (plugins/limits.json)
            if self.page_size not in sizes:
                raise UserError(f"page size {self.page_size} is not one the PagedAttention plugin supports",
                                f"use --page-size {', '.join(map(str, sizes))}")
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
        """Cache key of the engine this config builds from a source (cache_key)."""
        return cache_key(self, source_sha)


# fields added after the first cache keys: in a key only when they differ from the default
LATER_FIELDS = ("page_size", "accuracy_level", "quant", "block_size", "alpha", "calib_text", "calib_samples", "trt",
                "preset", "trt_version", "capacity", "max_batch", "quantize_lm_head", "custom_ops", "custom_attention",
                "lora", "kv_budget", "kv_dtype")
# fields read only by a pass pipeline (quantization, calibration, the ORT lowering of quantized weights)
PASS_FIELDS = ("block_size", "alpha", "calib_text", "calib_samples", "accuracy_level")


def _unused_fields(config: BuildConfig) -> set[str]:
    """Fields no step of `config`'s build reads: dropped from its key."""
    unused = set()
    if config.kv_layout != "paged":
        unused.add("page_size")
    if config.kv_layout != "ring":
        unused |= {"kv_sinks", "kv_window"}
    if config.kv_layout != "h2o":
        unused.add("kv_budget")
    calibrated_kv = config.target == "ort-cuda" and config.kv_dtype != "fp16"
    if not (config.quant or config.passes or calibrated_kv):
        unused |= set(PASS_FIELDS)
    return unused


def key_fields(config: BuildConfig) -> dict:
    """The settings of `config` that name its engine (see the module docstring)."""
    fields_ = {k: v for k, v in asdict(config).items() if k not in ("model", "target")}
    fields_["backend"] = config.backend  # the keys from before targets: "ort" | "trt"
    if config.target == "ort-cuda":
        fields_["target"] = config.target
    if config.kv_layout == "dense":  # dense engines keep the keys they had before the kv_ options (but a
        # quantized KV format, --for-cuda --custom-attention, names its engine)
        fields_ = {k: v for k, v in fields_.items() if not k.startswith("kv_") or (k == "kv_dtype" and v != "fp16")}
    # plain engines keep the keys they had before the pass, TensorRT and CUDA options
    plain = asdict(type(config)())
    fields_ = {k: v for k, v in fields_.items() if k not in LATER_FIELDS or v != plain[k]}
    for name in _unused_fields(config):
        fields_.pop(name, None)
    fields_["passes"] = fields_.get("passes") or []
    if config.lora:  # the adapter's content, not its path, names the engine
        fields_["lora"] = lora_adapter.resolve(config.lora)[1]
    return fields_


def cache_key(config: BuildConfig, source_sha: str) -> str:
    settings = json.dumps(key_fields(config), sort_keys=True)
    return f"{source_sha[:16]}-{hashlib.sha256((settings + __version__).encode()).hexdigest()[:12]}"
