"""The I/O contract of an exported graph and the custom-op domains, named once.

Dimension legend: B batch, S new tokens, P past tokens, Hkv key/value heads, D head size.

    inputs   input_ids [B, S]   attention_mask [B, P+S]   position_ids [B, S]
             past_key_values.{i}.key / .value   [B, Hkv, P, D]    (past_key(i), past_value(i))
             past_sinks.{i}.key / .value        ring layout only (past_sink_key(i), ...)
    outputs  logits [B, S, V]
             present.{i}.key / .value           [B, Hkv, P+S, D]  (present_key(i), present_value(i))
             present_sinks.{i}.key / .value     ring layout only

The exporter (export/kv_io.py) writes these names, the KV passes keep them, and every runtime reads
them; a KV input's output is its name with the past prefix swapped for the present one (`present_of`).
"""

from __future__ import annotations

import re

# ---- graph inputs and outputs ---------------------------------------------------------------------

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"
POSITION_IDS = "position_ids"
LOGITS = "logits"

PAST = "past_key_values."          # prefix of the KV-cache inputs
PRESENT = "present."               # prefix of the KV-cache outputs
PAST_SINKS = "past_sinks."         # ring layout: the attention-sink inputs
PRESENT_SINKS = "present_sinks."   # ring layout: the attention-sink outputs

# The KV layouts' own inputs (made by the kv_ring / kv_paged passes, fed by runtime/kv/kv_ring.py, kv_paged.py).
CACHE_POSITIONS = "cache_positions"   # ring [B, C]
WRITE_INDICES = "write_indices"       # ring [B]; its presence marks a ring graph
SINK_SOURCES = "sink_sources"         # ring [B, s]
ATTENTION_SCORES = "attention_scores."  # h2o (a ring graph + kv_h2o): outputs [B, H, C] per layer
BLOCK_TABLES = "block_tables"         # paged [B, MB] int32; its presence marks a paged graph
CONTEXT_LENS = "context_lens"         # paged [B] int32
SLOT_MAPPING = "slot_mapping"         # paged [B, S] int32
PAGED_INPUTS = (BLOCK_TABLES, CONTEXT_LENS, SLOT_MAPPING)

_PAST_RE = re.compile(r"past_key_values\.(\d+)\.(key|value)")


def past_key(i: int) -> str:
    return f"{PAST}{i}.key"


def past_value(i: int) -> str:
    return f"{PAST}{i}.value"


def present_key(i: int) -> str:
    return f"{PRESENT}{i}.key"


def present_value(i: int) -> str:
    return f"{PRESENT}{i}.value"


def past_name(i: int, kind: str) -> str:
    """`past_key_values.{i}.{kind}`, kind "key" or "value"."""
    return f"{PAST}{i}.{kind}"


def present_name(i: int, kind: str) -> str:
    return f"{PRESENT}{i}.{kind}"


def past_sinks_name(i: int, kind: str) -> str:
    return f"{PAST_SINKS}{i}.{kind}"


def present_sinks_name(i: int, kind: str) -> str:
    return f"{PRESENT_SINKS}{i}.{kind}"


def is_past(name: str) -> bool:
    return name.startswith(PAST)


def is_present(name: str) -> bool:
    return name.startswith(PRESENT)


def is_past_sinks(name: str) -> bool:
    return name.startswith(PAST_SINKS)


def present_of(past: str) -> str:
    """The output that carries input `past` forward: past_key_values.i.k -> present.i.k,
    past_sinks.i.k -> present_sinks.i.k."""
    if past.startswith(PAST):
        return PRESENT + past[len(PAST):]
    if past.startswith(PAST_SINKS):
        return PRESENT_SINKS + past[len(PAST_SINKS):]
    raise ValueError(f"{past!r} is not a KV-cache input")


def layer_of(name: str | None) -> int | None:
    """The layer number of a `past_key_values.{i}.key/value` name, else None."""
    found = _PAST_RE.fullmatch(name or "")
    return int(found.group(1)) if found else None


def input_names(layers: int) -> list[str]:
    """The exported graph's inputs, in order."""
    names = [INPUT_IDS, ATTENTION_MASK, POSITION_IDS]
    for i in range(layers):
        names += [past_key(i), past_value(i)]
    return names


def output_names(layers: int) -> list[str]:
    """The exported graph's outputs, in order."""
    names = [LOGITS]
    for i in range(layers):
        names += [present_key(i), present_value(i)]
    return names


# ---- custom-op domains ----------------------------------------------------------------------------

MS_DOMAIN = "com.microsoft"        # ONNX Runtime's contrib ops (GroupQueryAttention, MatMulNBits, ...)
# The project's own ops live under two domains, one per consumer:
ORT_OPS_DOMAIN = "com.enginesmith"  # ops of the ONNX Runtime custom-op library (plugins/ort_ops), run by ORT
GRAPH_DOMAIN = "enginesmith"        # graph-level IR ops (PagedAttention, SparseGemm) that the TensorRT
                                    # lowering maps to plugins; also their plugin_namespace
TRT_DOMAIN = "trt.plugins"          # TensorRT plugin nodes, as TensorRT's ONNX parser reads them


__all__ = [
    "INPUT_IDS", "ATTENTION_MASK", "POSITION_IDS", "LOGITS", "CACHE_POSITIONS", "WRITE_INDICES", "SINK_SOURCES",
    "BLOCK_TABLES", "CONTEXT_LENS", "SLOT_MAPPING", "PAGED_INPUTS", "PAST", "PRESENT", "PAST_SINKS", "PRESENT_SINKS",
    "past_key", "past_value", "present_key", "present_value", "past_name", "present_name", "past_sinks_name",
    "present_sinks_name", "is_past", "is_present", "is_past_sinks", "present_of", "layer_of", "input_names",
    "output_names", "MS_DOMAIN", "ORT_OPS_DOMAIN", "GRAPH_DOMAIN", "TRT_DOMAIN",
]


# ---- the CUDA decode path's KV buffer (build --for-cuda), shared by build and runtime
GQA_IO = "gqa-shared-buffer"   # build.json kv_layout.io: GroupQueryAttention on one shared KV buffer
MAX_CUDA_BATCH = 256           # most rows of that buffer (--max-batch), each of the full capacity
PAGED_GQA_IO = "paged-gqa"     # kv_layout.io of build --for-cuda --kv paged: PagedGroupQueryAttention on
                               # page pools fed block_tables, context_lens, slot_mapping (passes/lower/ort_paged_gqa.py)
