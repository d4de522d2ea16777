"""Tiny random models of every supported family, for tests that must run in seconds.

Their vocabulary has SmolLM2's size (49152), the rest is small; their tokenizer is built in code
(models.random_tokenizer) to fit whatever vocab_size a config has.
Also the realistic-size random configs used by speed benchmarks (weights random, shapes real).
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from enginesmith.core.errors import UserError

VOCAB = 49152

_TINY: dict[str, dict] = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True),
    # head size 64, as the ORT attention op and the paged-attention kernels take (llama's is 16)
    "llama-hd64": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                       rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=False),
    # ByteDance Seed-OSS: a Qwen2-shaped decoder (biases on q, k, v; none on o); its own model_type
    "seed_oss": dict(model_type="seed_oss", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                     rope_theta=10000.0, attention_bias=True, attention_out_bias=False, tie_word_embeddings=False),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                    rope_theta=10000.0, sliding_window=None, tie_word_embeddings=False),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512,
                 tie_word_embeddings=True),
    # Llama 3.x: rope_type "llama3" with a small original context so every frequency band differs
    "llama3": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "granite": dict(model_type="granite", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    rope_theta=10000.0, embedding_multiplier=12.0, residual_multiplier=0.22,
                    attention_multiplier=0.0625, logits_scaling=8.0, tie_word_embeddings=True),
    "olmo2": dict(model_type="olmo2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=False),
    # Phi-3.5: LongRoPE past 32 positions (the tests' 64 greedy tokens cross it)
    "phi3": dict(model_type="phi3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                 original_max_position_embeddings=32,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0 + 0.1 * i for i in range(8)],
                                  "long_factor": [1.0 + 0.5 * i for i in range(8)],
                                  "original_max_position_embeddings": 32}, tie_word_embeddings=False),
    # Gemma: head_dim 256 as the real ones, a window of 8 so that the tests' prompts exceed it
    "gemma2": dict(model_type="gemma2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
                   sliding_window=8, query_pre_attn_scalar=256, rope_theta=10000.0, tie_word_embeddings=True),
    "gemma3": dict(model_type="gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, head_dim=256, max_position_embeddings=512,
                   sliding_window=8, query_pre_attn_scalar=256, layer_types=["sliding_attention", "full_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                       "factor": 8.0}},
                   tie_word_embeddings=True),
    # Mistral with a real sliding window (every layer)
    "mistral-sw": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                       rope_theta=10000.0, sliding_window=8, tie_word_embeddings=False),
}

# Shapes of real models, random weights: for speed benchmarks only.
_RANDOM: dict[str, dict] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048,
                         intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0,
                         tie_word_embeddings=True),
}


def names() -> list[str]:
    return [f"tiny:{n}" for n in _TINY] + [f"random:{n}" for n in _RANDOM]


def config_for(spec: str) -> PretrainedConfig:
    """The config of `tiny:<family>` or `random:<shape>`."""
    kind, _, name = spec.partition(":")
    table = {"tiny": _TINY, "random": _RANDOM}.get(kind, {})
    if name not in table:
        raise UserError(f"unknown random model {spec!r}", f"use one of: {', '.join(names())}")
    params = dict(table[name])
    params.setdefault("vocab_size", VOCAB)
    params.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model_type = params.pop("model_type")
    return AutoConfig.for_model(model_type, **params)


def build(spec: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised model for `spec`; the same seed gives the same weights."""
    config = config_for(spec)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # from_config's init is tiny in magnitude; widen it so logits are not all ~0 and tests can fail.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    return model.eval()
