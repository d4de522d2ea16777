"""The model families enginesmith supports, and the one check that says so."""

from __future__ import annotations

from dataclasses import dataclass

from enginesmith.core.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str            # short name used by `tiny:<name>` and in messages
    model_type: str      # config.model_type
    architecture: str    # config.architectures[0]
    norm: str            # "rms" or "layer": what SmoothQuant folds into


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "llama", "LlamaForCausalLM", "rms"),
        Family("qwen2", "qwen2", "Qwen2ForCausalLM", "rms"),
        Family("mistral", "mistral", "MistralForCausalLM", "rms"),
        Family("gpt2", "gpt2", "GPT2LMHeadModel", "layer"),
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
