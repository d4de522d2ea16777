"""The KV layouts, named once: what a build may ask for, what build.json and a graph record, and how
the runtime learns a graph's layout (from the graph's own metadata, never from its input names).

    --kv / BuildConfig.kv_layout   dense | ring | paged | h2o      (BUILD_CHOICES)
    build.json kv_layout.type      dense | ring | paged            (LAYOUTS; h2o is a ring of policy h2o)
    build.json kv_layout.policy    ring only: streaming (sinks + window, the default) | h2o (heavy hitters)
    build.json kv_layout.kv_dtype  CUDA engines: fp16 (absent) | int8 | fp8 (KV_DTYPES: the pages' or
                                   the attention op's KV buffers' format)
    graph metadata GRAPH_KEY       JSON {"type", ...}: written by the passes that change the KV I/O
                                   (passes/kv), read by the runtime (graph_layout); absent = dense

The pure step arithmetic of each layout (the feeds of a ring or paged step) is core/kv_layout.py.
"""

from __future__ import annotations

import json
from typing import Mapping

LAYOUTS = ("dense", "ring", "paged")
RING_POLICIES = ("streaming", "h2o")
BUILD_CHOICES = ("dense", "ring", "paged", "h2o")
KV_DTYPES = ("fp16", "int8", "fp8")
PAGE_SIZE = 16                      # tokens per KV page: the paged build's default
GRAPH_KEY = "enginesmith.kv_layout"  # ONNX metadata_props key of a graph's layout (JSON)
_MAX_GRAPH_VALUE = 4096              # a graph is untrusted input: a longer value is not read


def stored_layout(choice: str) -> tuple[str, str | None]:
    """A --kv choice as build.json stores it: (type, ring policy or None)."""
    if choice not in BUILD_CHOICES:
        raise ValueError(f"unknown KV layout {choice!r}: one of {', '.join(BUILD_CHOICES)}")
    return ("ring", "h2o") if choice == "h2o" else (choice, None)


def graph_layout(metadata: Mapping[str, str]) -> dict:
    """A graph's KV layout from its metadata (an ONNX model's metadata_props, or an ORT session's
    custom_metadata_map): the JSON object the KV passes wrote, with "type" one of LAYOUTS; {"type":
    "dense"} when there is none. A value that is too long, not JSON, or of an unknown type is
    refused with ValueError, since the graph would then be run with the wrong feeds."""
    raw = metadata.get(GRAPH_KEY, "")
    if not raw:
        return {"type": "dense"}
    if len(raw) > _MAX_GRAPH_VALUE:
        raise ValueError(f"the graph's {GRAPH_KEY} metadata is {len(raw)} characters (at most {_MAX_GRAPH_VALUE})")
    try:
        layout = json.loads(raw)
    except ValueError:
        raise ValueError(f"the graph's {GRAPH_KEY} metadata is not JSON") from None
    if not isinstance(layout, dict) or layout.get("type") not in LAYOUTS:
        raise ValueError(f"the graph's {GRAPH_KEY} metadata names no KV layout of {', '.join(LAYOUTS)}")
    policy = layout.get("policy", "streaming" if layout["type"] == "ring" else None)
    if layout["type"] == "ring" and policy not in RING_POLICIES:
        raise ValueError(f"the graph's ring policy {policy!r} is not one of {', '.join(RING_POLICIES)}")
    return layout
