"""What each layer's attention does beyond plain causal softmax, written into the exported graph.

The export knows the config; the passes see only the graph. So the export records, per layer, the
sliding window (keys a query sees, itself included, as transformers' `q - k < window`) and the
attention soft-cap, in the ONNX metadata key `enginesmith.attention`:

    {"layers": [{"window": 8, "softcap": 50.0}, {"window": null, "softcap": 50.0}, ...],
     "final_logit_softcap": 30.0}

A KV layout or lowering that would drop a window or a soft-cap reads this and refuses (or keeps it).
A graph without the key (exported before it existed) has plain layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

METADATA_KEY = "enginesmith.attention"


@dataclass(frozen=True)
class LayerAttention:
    window: int | None = None     # keys a query attends to, itself included; None = all
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap); None = none


def of_config(config) -> dict:
    """The metadata of a transformers config: per-layer windows (the cache layers transformers itself
    builds for the config tell which layers slide) and soft-caps."""
    from transformers import DynamicCache  # deferred: imports torch; readers of the metadata need neither

    windows = [getattr(layer, "sliding_window", None) for layer in DynamicCache(config=config).layers]
    softcap = getattr(config, "attn_logit_softcapping", None)
    return {"layers": [{"window": w, "softcap": softcap} for w in windows],
            "final_logit_softcap": getattr(config, "final_logit_softcapping", None)}


def dumps(meta: dict) -> str:
    return json.dumps(meta, sort_keys=True)


def layers(metadata_props: dict) -> list[LayerAttention]:
    """Per-layer attention of a graph's metadata (an onnx_ir model's `metadata_props`); [] if none."""
    text = metadata_props.get(METADATA_KEY)
    if not text:
        return []
    return [LayerAttention(entry.get("window"), entry.get("softcap")) for entry in json.loads(text)["layers"]]


def windows(metadata_props: dict) -> set[int]:
    """The distinct sliding windows of a graph's layers (empty: no sliding layer)."""
    return {layer.window for layer in layers(metadata_props) if layer.window is not None}


def sliding_reason(metadata_props: dict, what: str) -> str | None:
    """Why `what` (a KV layout, a lowering) cannot take a graph with sliding-window layers, or None."""
    found = windows(metadata_props)
    if not found:
        return None
    count = sum(layer.window is not None for layer in layers(metadata_props))
    return (f"{count} of {len(layers(metadata_props))} layers attend through a sliding window of "
            f"{', '.join(map(str, sorted(found)))} tokens, which {what} does not implement")


def unfused_reason(metadata_props: dict) -> str | None:
    """Why an exported graph has no Attention op, when its metadata explains it (soft-capping)."""
    caps = {layer.softcap for layer in layers(metadata_props) if layer.softcap}
    if not caps:
        return None
    return (f"its attention soft-capping ({', '.join(map(str, sorted(caps)))}: Gemma 2) is exported as "
            "MatMul, Div, Tanh, Mul, Softmax, not as an Attention op (the fuse_attention pass fuses it)")
