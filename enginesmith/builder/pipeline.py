"""The pass pipeline a build runs, as typed steps (passes.typed_step), in order:

    ort-cpu, trt   [preset and/or --passes]  [the KV layout's pass]  [the backend's lowering]
    ort-cuda       [fuse_attention] lower_gqa skip_rmsnorm [untie_lm_head] [quantize_w4a16 lower_ort]
                   matmul_transb [ort_gemv [ort_attention]] [paged_gqa | quantize_kv]

Steps are built from the BuildConfig's values, never written as text and parsed back; text is the
user's (--passes) and the presets' (passes/manager/presets.py). build.json records `step.spec()` of each.
"""

from __future__ import annotations

from pathlib import Path

from enginesmith.builder.config import BuildConfig
from enginesmith.plugins import ort_ops


def steps(config: BuildConfig, max_positions: int | None = None, unfused_attention: bool = False) -> list:
    """The pass steps of a build, in order: quantization preset and/or explicit passes, the KV layout,
    the lowering for the target (empty for a plain dense ort-cpu or trt engine). An ort-cuda build's
    KV capacity is config.capacity, else `max_positions` (the model's context); `unfused_attention`:
    its source graph has no Attention op (Gemma 2's soft-capping is exported eagerly), fused first."""
    from enginesmith.passes import build_pipeline  # deferred: imports onnx, onnxruntime

    if config.target == "ort-cuda":
        if not (config.capacity or max_positions):
            raise ValueError("an ort-cuda pipeline needs the KV capacity (config.capacity or max_positions)")
        return cuda_steps(config, config.capacity or max_positions, unfused_attention)
    if not (config.quant or config.passes or config.kv_layout != "dense"):
        return []
    pass_steps = build_pipeline(quant=config.quant, passes_text=config.passes, block_size=config.block_size,
                                alpha=config.alpha, backend=config.backend, accuracy_level=config.accuracy_level)
    at = next((i for i, s in enumerate(pass_steps) if s.name.startswith("lower_")), len(pass_steps))
    pass_steps[at:at] = kv_steps(config)  # the layout's rewrite sees the quantized graph, before the lowering
    return pass_steps


def kv_steps(config: BuildConfig) -> list:
    """The KV layout's steps of an ort-cpu or trt build (none for dense)."""
    from enginesmith.passes import typed_step  # deferred: imports onnx, onnxruntime

    if config.kv_layout == "ring":
        return [typed_step("kv_ring", sinks=config.kv_sinks, window=config.kv_window)]
    if config.kv_layout == "h2o":  # a ring of no sinks whose attention scores drive the evictions
        return [typed_step("kv_ring", sinks=0, window=config.kv_budget), typed_step("kv_h2o")]
    if config.kv_layout == "paged":  # the CPU lowering is a decomposed reference; TensorRT gets the plugin
        return [typed_step("kv_paged", page_size=config.page_size, lower="trt" if config.target == "trt" else "cpu")]
    return []


def cuda_steps(config: BuildConfig, capacity: int, unfused_attention: bool = False) -> list:
    """ort-cuda: an eager-exported attention as the Attention op first (fuse_attention, only when
    `unfused_attention`), GroupQueryAttention on shared KV buffers (lower_gqa), fused residual norms
    (skip_rmsnorm), with w4a16-rtn int4 weights as MatMulNBits (the lm_head too with quantize_lm_head,
    after untie_lm_head gives a tied one its own matrix), and the remaining fp16 MatMuls as
    FusedMatMul(transB) on [N, K] weights (matmul_transb: a tied lm_head then reads the embedding table
    instead of a transposed copy ORT would fold at load); with the custom ops, the decode GEMVs
    (ort_gemv) and optionally the attention (ort_attention) as enginesmith's ORT ops. A paged engine
    has them all and ends with paged_gqa (the attention over page pools). A dense engine with a quantized
    kv_dtype ends with quantize_kv (its attention op's KV buffers as codes)."""
    from enginesmith.passes import typed_step  # deferred: imports onnx, onnxruntime

    out = [typed_step("fuse_attention")] if unfused_attention else []
    out += [typed_step("lower_gqa", capacity=capacity), typed_step("skip_rmsnorm")]
    if config.quant == "w4a16-rtn":
        out += [typed_step("untie_lm_head")] if config.quantize_lm_head else []
        out += [typed_step("quantize_w4a16", block_size=config.block_size, include_lm_head=config.quantize_lm_head),
                typed_step("lower_ort")]
    out.append(typed_step("matmul_transb"))  # remaining fp16 MatMuls on [N, K] weights: a tied lm_head needs no copy
    if config.kv_layout == "paged":
        kv_dtype = {"kv_dtype": config.kv_dtype} if config.kv_dtype != "fp16" else {}
        return out + [typed_step("ort_gemv"), typed_step("ort_attention"),
                      typed_step("paged_gqa", page_size=config.page_size, **kv_dtype)]
    if config.custom_ops or config.custom_attention or (config.custom_ops is None and ort_ops.available()):
        out.append(typed_step("ort_gemv"))
        out += [typed_step("ort_attention")] if config.custom_attention else []
    if config.kv_dtype != "fp16":  # dense, with custom_attention (validate): the op's KV buffers quantized
        out.append(typed_step("quantize_kv", kv_dtype=config.kv_dtype))
    return out


def unfused_attention(graph: Path) -> bool:
    """Whether an exported graph has no Attention op (its attention is MatMul ... Softmax ... MatMul)."""
    import onnx  # deferred: imports protobuf; the weights stay on disk (external data)

    return not any(n.op_type == "Attention" for n in onnx.load(str(graph), load_external_data=False).graph.node)
