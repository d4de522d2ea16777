"""kv_layout=paged: the concat-grown KV cache -> `enginesmith.PagedAttention` over page pools.

A dense graph grows each layer's cache by Concat(past, new) and attends under a mask built from
attention_mask. The paged graph instead reads and writes fixed page pools [NB, BS, Hkv, D] (BS =
page_size tokens a page), addressed per step by three int32 inputs that the runtime's block manager
fills (runtime/kv/kv_paged.py): block_tables [B, MB] (each row's pages), context_lens [B] (positions
after the step) and slot_mapping [B, S] (where each new token's K/V goes); attention_mask leaves
the graph. Two steps, one module each:

  paged_rewrite   every layer's Attention -> enginesmith.PagedAttention (the IR op; `lower=none`
                  stops here, to be lowered later by the `lower_paged` pass, lower/paged_lower.py)
  paged_lower     the IR op -> cpu: standard ops (ScatterND/Gather/Attention, any ONNX Runtime EP),
                  cuda: com.microsoft.PagedAttention, trt: the TensorRT plugin node

Exactness: with `lower=cpu` the pass is exact, and the pass manager compares the paged graph with
the dense graph before it (verify.compare drives it through paged_verify: the paged layout's feeds from
core/kv_layout.py over a prefill and decode steps, batch 2) and stops the pipeline on a mismatch. The other lowerings
do not run on ONNX Runtime's CPU EP, so they are not compared (nor is `verify=false`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from enginesmith.core.errors import UserError
from enginesmith.passes.lower.paged_lower import TARGETS, lower_paged_graph
from enginesmith.passes.kv.paged_rewrite import rewrite_paged
from enginesmith.passes.machinery.registry import PassContext, PassResult, register

LOWERINGS = (*TARGETS, "none")


@dataclass(frozen=True)
class KVPagedParams:
    page_size: int = 16
    lower: str = "cpu"
    verify: bool = True  # let the pass manager compare the paged graph with the dense one (lower=cpu)

    def __post_init__(self):
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise UserError(f"kv_paged page_size={self.page_size!r} must be a positive integer",
                            "use 16, 32 or 64 (the sizes the TensorRT plugin supports)")
        if self.lower not in LOWERINGS:
            raise UserError(f"kv_paged lower={self.lower!r} is not one of {', '.join(LOWERINGS)}",
                            "use cpu (ONNX Runtime, any EP), cuda (com.microsoft.PagedAttention), trt or none")


@register("kv_paged", KVPagedParams, exact=lambda p: p.lower == "cpu" and p.verify)
def kv_paged(model: ir.Model, params: KVPagedParams | None = None, ctx: PassContext | None = None) -> PassResult:
    """Dense concat KV cache -> enginesmith.PagedAttention over page pools + block tables + slot
    mapping, lowered for cpu (standard ops), cuda (com.microsoft.PagedAttention) or trt (plugin).
    Exact; with lower=cpu the pass manager compares it with the dense graph."""
    params = params or KVPagedParams()
    counts = rewrite_paged(model, params.page_size)
    if params.lower != "none":
        counts["lowered"] = lower_paged_graph(model, params.lower)
    return PassResult(counts)
