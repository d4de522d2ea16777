"""Linears and foldable sites found by the pattern rules, with the reasons for what is left out."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from enginesmith.passes.analysis.linears import find_linears, select
from enginesmith.passes.analysis.sites import find_sites, plan


def test_llama_linears_and_sites(tiny_onnx):
    model = ir.load(tiny_onnx("llama"))
    linears, rejected = find_linears(model)
    assert len(linears) == 2 * 7 + 1 and not rejected          # q k v o gate up down per layer + lm_head
    lm_head = [lin for lin in linears if lin.is_lm_head]
    assert len(lm_head) == 1 and lm_head[0].k_axis == 1       # tied: MatMul(x, Transpose(E))
    chosen, skipped = select(linears, include_lm_head=False)
    assert len(chosen) == 14 and "lm_head" in skipped[0].reason
    sites, why = find_sites(model, linears, chosen)
    kinds = [s.kind for s in sites]
    assert kinds.count("norm") == 4 and kinds.count("attn_v") == 2 and kinds.count("mlp_up") == 2
    assert not why                                             # every quantized linear is smoothed
    assert sorted(len(s.consumers) for s in sites if s.kind == "norm") == [2, 2, 3, 3]


def test_gqa_channel_map(tiny_onnx):
    """tiny llama: 4 query heads share 2 kv heads of dim 16; q head h reads kv head h // 2."""
    model = ir.load(tiny_onnx("llama"))
    sites, _ = plan(model, False, True, True)
    v = next(s for s in sites if s.kind == "attn_v")
    assert v.channels == 32 and v.consumers[0].k == 64
    heads = np.arange(64) // 16
    assert np.array_equal(v.expand // 16, heads // 2)
    assert np.array_equal(v.expand % 16, np.arange(64) % 16)
    assert np.allclose(v.pool(np.arange(64.0), np.mean)[:16], np.arange(16) + 8)


def test_gpt2_sites_and_reasons(tiny_onnx):
    model = ir.load(tiny_onnx("gpt2"))
    sites, skipped = plan(model, False, True, True)
    assert [s.kind for s in sites] == ["norm"] * 4             # ln_1 -> c_attn, ln_2 -> c_fc (Gemm)
    assert all(len(s.divide) == 2 for s in sites)              # gamma and beta
    reasons = {r.node: r.reason for r in skipped}
    not_smoothed = [r for r in skipped if r.rule == "site"]
    assert len(not_smoothed) == 4                              # attn c_proj and mlp c_proj, 2 layers
    assert any("Mul" in r.reason for r in not_smoothed)        # GELU output feeds mlp c_proj
    assert any("lm_head" in reason for reason in reasons.values())


def test_switches_report_what_is_off(tiny_onnx):
    model = ir.load(tiny_onnx("qwen2"))
    sites, skipped = plan(model, False, through_v=False, through_up=True)
    assert {s.kind for s in sites} == {"norm", "mlp_up"}
    assert sum("through_v=false" in r.reason for r in skipped) == 2
    v_bias = plan(model, False, True, True)[0]
    assert any(s.kind == "attn_v" and len(s.divide) == 2 for s in v_bias)  # qwen2: v weight + bias
