"""`enginesmith build`: an engine directory (graph, tokenizer, build.json) for ONNX Runtime, ONNX
Runtime CUDA (--for-cuda) or TensorRT (--backend trt)."""

from __future__ import annotations

from enginesmith.builder import trt as trt_build
from enginesmith.builder.engine import BuildConfig, build
from enginesmith.cli.flags import add_kv_flags, add_model_flags
from enginesmith.core.errors import UserError
from enginesmith.core.out_paths import check_out
from enginesmith.core.quant_spec import PRESETS
from enginesmith.models import corpus


def add_parser(verbs) -> None:
    p = verbs.add_parser("build", help="build an engine directory (graph, tokenizer, build.json)")
    add_model_flags(p, engine=False)
    p.add_argument("--out", required=True, help="engine directory to create")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--opset", type=int, default=23)
    p.add_argument("--backend", default="ort", choices=["ort", "trt"],
                   help="ort (ONNX Runtime, default) or trt (TensorRT: needs tensorrt and a GPU)")
    p.add_argument("--force", action="store_true", help="replace an existing engine directory")
    p.add_argument("--for-cuda", action="store_true",
                   help="lower for ONNX Runtime CUDA's decode loop (GroupQueryAttention on one KV buffer, "
                        "CUDA graphs, sampling on the device); fp16/bf16, optional --quant w4a16-rtn; with "
                        "--kv paged (fp16, the custom ops): page pools for in-flight batching (--page-size 16/32/64)")
    p.add_argument("--custom-ops", default="auto", choices=["auto", "on", "off"],
                   help="with --for-cuda: run the decode GEMVs as enginesmith's ONNX Runtime ops "
                        "(libenginesmith_ort_ops.so; auto: when it is built)")
    p.add_argument("--custom-attention", action="store_true",
                   help="with --for-cuda: the attention as enginesmith's ORT op too (one kernel per layer: "
                        "faster decode at short contexts; prompts run slower than ORT's flash attention)")
    p.add_argument("--max-batch", type=int, default=None, metavar="N",
                   help="with --for-cuda: sequences run at once (rows of the KV buffer the runtime allocates, "
                        "each of the full capacity; default: as many as the prompts); with --kv paged: most "
                        "rows per step (default 64)")
    p.add_argument("--capacity", type=int, default=None, metavar="POSITIONS",
                   help="with --for-cuda: KV positions a sequence may reach (default: the model's context); a "
                        "smaller one makes the rotary tables, the KV rows and the paged block tables smaller")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="with --for-cuda --quant w4a16-rtn: the lm_head int4 too (a tied one gets its own matrix)")
    add_kv_flags(p)
    p.set_defaults(page_size=None)  # given or not: it applies to --kv paged only (default 16 there)
    p.add_argument("--kv-dtype", default="fp16", choices=["fp16", "int8", "fp8"],
                   help="with --for-cuda --kv paged: the KV pages' format; with --for-cuda --custom-attention "
                        "(dense): the KV buffers'. int8 / fp8 (e4m3) hold codes with static per-channel scales "
                        "calibrated on --calib-text (half the bytes of fp16: twice the tokens per GPU; SmolLM2 "
                        "perplexity +0.03 %% int8, +0.5 %% fp8)")
    p.add_argument("--lora", metavar="ADAPTER_DIR", default=None,
                   help="fold a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into "
                        "the weights at export")
    g = p.add_argument_group("graph passes (see docs: SmoothQuant, W8A8, W4A16 RTN/AWQ/GPTQ, ...)")
    g.add_argument("--quant", default=None, choices=list(PRESETS), help="quantization preset")
    g.add_argument("--passes", default=None, metavar="PIPELINE",
                   help="explicit passes, e.g. smoothquant:alpha=0.6,quantize_w8a8 (after --quant's)")
    g.add_argument("--block-size", type=int, default=128, help="W4A16 block size along K (32/64/128)")
    g.add_argument("--alpha", type=float, default=None,
                   help="SmoothQuant migration strength in [0, 1] for the whole model (default: searched per layer)")
    g.add_argument("--calib-text", metavar="FILE", default=None,
                   help="calibration text (default: Pride and Prejudice)")
    g.add_argument("--calib-samples", type=int, default=32, help="calibration sequences of 512 tokens")
    g.add_argument("--accuracy-level", type=int, default=0, choices=[0, 1, 2, 3, 4],
                   help="ORT MatMulNBits compute: 0 = fp activations (default), 4 = int8 activations "
                        "(SmolLM2 W4A16 on CPU: 1.7x faster decode, perplexity 28.44 -> 28.48)")
    trt_build.add_arguments(p)
    p.set_defaults(func=cmd_build)


def cmd_build(args) -> int:
    """One BuildConfig (target ort-cpu, ort-cuda with --for-cuda, or trt); it refuses what its target
    does not build. Only flags given without effect are checked here: the config cannot tell them."""
    target = "ort-cuda" if args.for_cuda else "trt" if args.backend == "trt" else "ort-cpu"
    config = BuildConfig(
        model=args.model, lora=args.lora, target=target, dtype=args.dtype, opset=args.opset,
        kv_layout=args.kv, kv_sinks=args.sinks, kv_window=args.kv_window, kv_budget=args.kv_budget, page_size=16 if args.page_size is None else args.page_size,
        kv_dtype=args.kv_dtype,
        quant=args.quant, passes=args.passes, block_size=args.block_size, alpha=args.alpha,
        calib_text=args.calib_text, calib_samples=args.calib_samples, accuracy_level=args.accuracy_level,
        max_batch=args.max_batch, quantize_lm_head=args.quantize_lm_head, capacity=args.capacity,
        custom_ops={"auto": None, "on": True, "off": False}[args.custom_ops], custom_attention=args.custom_attention,
        trt=trt_build.config_from_args(args) if args.backend == "trt" else None, preset=args.preset,
        trt_version=args.trt_version)
    if args.page_size is not None and args.kv != "paged":
        raise UserError(f"--page-size applies to --kv paged, not --kv {args.kv}", "add --kv paged, or drop --page-size")
    if args.calib_text is not None:  # read at calibration, minutes in: a bad file fails here, at once
        corpus.load_text(args.calib_text)
    print(build(config, check_out(args.out, "--out", "dir"), force=args.force))
    return 0
