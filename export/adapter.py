"""The one place that knows how transformers' cache API looks in the installed version.

transformers 5.x renamed the forward keyword `past_key_values=` to `cache=` (the old name is
deprecated from 5.2x and removed later) and stores per-layer tensors as `cache.layers[i].keys /
.values` (older: `key_cache[i]` / `value_cache[i]`). Everything else calls these helpers.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache


def cache_keyword(model) -> str:
    """The forward() keyword that takes the KV cache: "cache" (new) or "past_key_values" (old)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(config, past: list[tuple[torch.Tensor, torch.Tensor]], keep_all: bool = False) -> DynamicCache:
    """A DynamicCache holding `past`: per layer (key, value), each [B, Hkv, P, D].

    By default its layers are the config's (a sliding-window layer keeps only its window, as
    transformers runs the model). `keep_all` makes every layer keep every token, as the exported
    graph does (present = past + new for every layer; the window is in the attention mask, which
    transformers builds from the config either way, and the ring KV layout drops what it masks)."""
    cache = DynamicCache() if keep_all else DynamicCache(config=config)
    for layer, (k, v) in enumerate(past):
        cache.update(k, v, layer)
    return cache


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (key, value) of a cache object returned by forward()."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def output_cache(outputs):
    """The cache object of a forward() output, whatever the field is called."""
    for name in ("cache", "past_key_values"):
        value = getattr(outputs, name, None)
        if value is not None:
            return value
    raise RuntimeError("the model returned no KV cache (was use_cache=True passed?)")


def forward(model, input_ids, attention_mask, position_ids, cache):
    """model(...) with the cache passed under the keyword this transformers version expects."""
    kwargs = {cache_keyword(model): cache}
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 use_cache=True, **kwargs)
