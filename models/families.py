"""The model families enginesmith supports, what each supports, and the one check that says so.

One table (FAMILIES) says what a family is made of (its `features`); one table (FEATURE_LIMITS)
says which passes, KV layouts and CUDA ops each feature rules out, and why. `support(family)` joins
them; `enginesmith models` prints it and tests/models/test_families.py checks it against the passes
themselves (a "yes" runs, a "no" is refused with a UserError). The passes decide from the graph
and the attention metadata the export writes (export/attention_meta.py), never from this table:
the table is the summary, the tests keep it honest.

    config.json ──family_of──▶ Family(features) ──support()──▶ {pass/layout/op: "yes" | reason}
                └─check_config──▶ rope type, attention variants: refused with what is supported
"""

from __future__ import annotations

from dataclasses import dataclass

from enginesmith.core import kv_spec
from enginesmith.core.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str            # short name used in messages and `enginesmith models`
    model_type: str      # config.model_type
    architecture: str    # config.architectures[0]
    norm: str            # "rms" or "layer": what SmoothQuant folds into
    rope_types: tuple[str, ...] = ("default",)   # rope_type values the export reproduces exactly
    features: tuple[str, ...] = ()               # keys of FEATURES beyond a plain pre-norm decoder
    optional: tuple[str, ...] = ()               # FEATURES some checkpoints have (see features_of)
    tiny: tuple[str, ...] = ()                   # the `tiny:<name>` models of this family (models/tiny.py)


# what each feature means, for `enginesmith models`
FEATURES: dict[str, str] = {
    "learned_positions": "learned absolute position embeddings (no RoPE)",
    "rope_llama3": "RoPE scaled by rope_type 'llama3' (frequency bands)",
    "rope_longrope": "LongRoPE (short/long factors chosen by the largest position)",
    "rope_per_layer_type": "RoPE parameters per layer type (sliding / full)",
    "qk_norm": "RMSNorm on q and k per head before RoPE",
    "rope_fp32": "q and k rotated in fp32 (cast back after) in an fp16 export",
    "post_norm": "norms after the attention and MLP blocks",
    "multipliers": "embedding, residual, attention and logit multipliers",
    "fused_projections": "one qkv and one gate_up projection, split in the graph",
    "softcap": "tanh soft-capping of attention and final logits",
    "sliding_window": "sliding-window attention layers",
    "alternating_layers": "sliding and global layers alternate (per-layer KV sizes)",
    "gelu_tanh": "GELU (tanh) gated MLP",
    "scaled_embeddings": "embeddings multiplied by sqrt(hidden)",
    "head_dim_256": "head size 256",
}

PASSES = ("smoothquant", "w4a16-rtn", "w4a16-awq", "w8a8")
KV_LAYOUTS = kv_spec.LAYOUTS
CUDA_OPS = ("GroupQueryAttention", "enginesmith.GroupQueryAttention", "enginesmith.PagedGroupQueryAttention")

# feature -> {pass, layout or op it rules out: the reason}. Anything not named runs.
FEATURE_LIMITS: dict[str, dict[str, str]] = {
    "learned_positions": {"ring": "the ring moves tokens to their cache positions, which needs RoPE",
                          "GroupQueryAttention": "GroupQueryAttention applies RoPE or none; GPT-2's "
                                                 "attention has no fused form"},
    "rope_longrope": {"ring": "LongRoPE's cos/sin are not fused into RotaryEmbedding by the exporter",
                      "GroupQueryAttention": "the attention is not fused (no RotaryEmbedding)"},
    "fused_projections": {"GroupQueryAttention": "the attention is not fused (no RotaryEmbedding)"},
    # (enginesmith.PagedGroupQueryAttention has soft-capping, windows, head size 256 and takes q/k norms:
    # tests/models/test_paged_families.py)
    "softcap": {"paged": "no soft-capping in the CPU paged layout (the CUDA paged engine has it: paged-gqa)"},
    "sliding_window": {"paged": "no sliding window in the CPU paged layout (the CUDA paged engine has it: "
                                "paged-gqa)"},
    # (ring: every layer sliding by one window W is the exact ring of --sinks 0, --kv-window >= W)
    "alternating_layers": {"ring": "sliding and global layers need different KV sizes; the ring "
                                   "layout has one size for all layers"},
}
# what a column needs besides its own limits: the paged CUDA engine is lowered from the GQA one
REQUIRES: dict[str, str] = {"enginesmith.PagedGroupQueryAttention": "GroupQueryAttention",
                            "enginesmith.GroupQueryAttention": "GroupQueryAttention"}  # --custom-attention

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama", "LlamaForCausalLM", "rms", ("default", "llama3"),
               tiny=("llama", "llama-hd64", "llama3")),
        Family("qwen2", "qwen2", "Qwen2ForCausalLM", "rms", tiny=("qwen2",)),
        Family("seed_oss", "seed_oss", "SeedOssForCausalLM", "rms", tiny=("seed_oss",)),
        Family("mistral", "mistral", "MistralForCausalLM", "rms", optional=("sliding_window",),
               tiny=("mistral", "mistral-sw")),
        Family("gpt2", "gpt2", "GPT2LMHeadModel", "layer", features=("learned_positions",), tiny=("gpt2",)),
        Family("qwen3", "qwen3", "Qwen3ForCausalLM", "rms", features=("qk_norm",), tiny=("qwen3",)),
        Family("granite", "granite", "GraniteForCausalLM", "rms", features=("multipliers",), tiny=("granite",)),
        Family("olmo2", "olmo2", "Olmo2ForCausalLM", "rms", features=("post_norm", "qk_norm", "rope_fp32"),
               tiny=("olmo2",)),
        Family("phi3", "phi3", "Phi3ForCausalLM", "rms", ("default", "longrope"),
               features=("fused_projections", "rope_longrope"), tiny=("phi3",)),
        Family("gemma2", "gemma2", "Gemma2ForCausalLM", "rms",
               features=("softcap", "sliding_window", "alternating_layers", "gelu_tanh", "scaled_embeddings",
                         "post_norm", "head_dim_256"), tiny=("gemma2",)),
        Family("gemma3", "gemma3_text", "Gemma3ForCausalLM", "rms", ("default", "linear"),
               features=("qk_norm", "sliding_window", "alternating_layers", "rope_per_layer_type", "gelu_tanh",
                         "scaled_embeddings", "post_norm", "head_dim_256"), tiny=("gemma3",)),
    )
}


def supported_names() -> str:
    return ", ".join(f"{f.name} ({f.architecture})" for f in FAMILIES.values())


def family_of(config) -> Family:
    """The Family of a transformers config, or a UserError naming the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        archs = getattr(config, "architectures", None) or [model_type]
        raise UserError(
            f"unsupported architecture {archs[0]!r} (model_type {model_type!r})",
            f"use a model of a supported family: {supported_names()}",
        )
    return FAMILIES[model_type]


def rope_types(rope: object) -> list[str]:
    """The rope_type values of a config's `rope_parameters` / `rope_scaling` (a dict, a dict per layer
    type, or None). The old key `type` counts as `rope_type`; a missing one is "default"."""
    if rope is None:
        return ["default"]
    if not isinstance(rope, dict):
        return [repr(rope)]
    if all(isinstance(v, dict) for v in rope.values()) and rope:  # per layer type (Gemma 3)
        return [t for v in rope.values() for t in rope_types(v)]
    kind = rope.get("rope_type", rope.get("type", "default"))
    return [kind if isinstance(kind, str) else repr(kind)]


def check_config(family: Family, config: dict) -> None:
    """Refuse what `family` does not support in a config (as a dict): a rope type, an attention
    variant. The message names the value and what is supported."""
    for key in ("rope_parameters", "rope_scaling"):
        for kind in rope_types(config.get(key)):
            if kind not in family.rope_types:
                raise UserError(f"{family.name} with {key} rope_type {kind!r} is not supported",
                                f"use a checkpoint whose rope_type is one of: {', '.join(family.rope_types)}")
    attn = config.get("attn_implementation") or config.get("_attn_implementation")
    if config.get("use_sliding_window") and "sliding_window" not in family.features:
        raise UserError(f"{family.name} with use_sliding_window is not supported",
                        "use a checkpoint without sliding-window layers (families with them: "
                        + ", ".join(f.name for f in FAMILIES.values() if "sliding_window" in f.features + f.optional) + ")")
    if attn not in (None, "eager", "sdpa"):
        raise UserError(f"attention implementation {attn!r} is not supported",
                        "use a checkpoint with attn_implementation eager or sdpa (or none)")


def features_of(family: Family, config) -> tuple[str, ...]:
    """The features a model (a transformers config) has: its family's, and the optional ones its
    config turns on (Mistral: a sliding window)."""
    on = {"sliding_window": getattr(config, "sliding_window", None) is not None}
    return family.features + tuple(f for f in family.optional if on.get(f, False))


def limits(features: tuple[str, ...]) -> dict[str, str]:
    """Every pass, KV layout and CUDA op: "yes", or the reasons `features` rule it out."""
    out = {}
    for what in PASSES + KV_LAYOUTS + CUDA_OPS:
        wanted = (what, REQUIRES[what]) if what in REQUIRES else (what,)
        reasons = [r for w in wanted for r in (FEATURE_LIMITS.get(f, {}).get(w) for f in features) if r]
        reasons = list(dict.fromkeys(reasons))  # one feature pair may give the same reason twice
        out[what] = "yes" if not reasons else "no: " + "; ".join(reasons)
    return out


def support(family: Family) -> dict[str, str]:
    """`limits` of the family's own features; what an optional feature rules out is added as
    "yes (not with <feature>: reason)"."""
    out = limits(family.features)
    for feature in family.optional:
        for what, verdict in limits(family.features + (feature,)).items():
            if out[what] == "yes" and verdict != "yes":
                out[what] = f"yes (not with {feature}: {verdict[4:]})"
    return out
