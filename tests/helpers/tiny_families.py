"""The tiny random model families (`tiny:<family>`) that tests run every feature over: three RoPE
families and a LayerNorm one (GPT-2)."""

FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]
