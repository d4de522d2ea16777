"""LoRA folding (`build --lora DIR`) against PEFT's own merge_and_unload, and the adapter checks."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from enginesmith.core.errors import UserError
from enginesmith.export.lora import fold_lora
from enginesmith.models.load import load
from enginesmith.models.lora_adapter import read_adapter

peft = pytest.importorskip("peft", reason="peft is in the test extra (pip install -e .[test])")

TARGETS = {"llama": ["q_proj", "v_proj", "o_proj", "down_proj"], "gpt2": ["c_attn", "c_fc"]}


def _adapter(family: str, folder, rank: int = 4, **config) -> torch.nn.Module:
    """A PEFT adapter with random A and B on tiny:<family>, saved to `folder`; returns PEFT's merged model."""
    torch.manual_seed(0)
    base = load(f"tiny:{family}").model
    lora = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[family],
                           init_lora_weights=False, fan_in_fan_out=family == "gpt2", **config)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # init_lora_weights=False draws B too; make the update large enough to matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(3.0)
    model.save_pretrained(folder)
    return model.merge_and_unload().eval()


IDS = torch.tensor(np.random.default_rng(0).integers(0, 49152, size=(1, 12)))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("rslora", [False, True])
def test_folded_weights_match_peft_merge(family, rslora, tmp_path):
    merged = _adapter(family, tmp_path, use_rslora=rslora)
    ours = load(f"tiny:{family}").model
    plain = ours(IDS).logits
    assert fold_lora(ours, read_adapter(tmp_path)) == 2 * len(TARGETS[family])
    with torch.no_grad():
        ref, got = merged(IDS).logits, ours(IDS).logits
    assert (ref - plain).abs().max() > 1e-2                       # the adapter changes the model
    assert (ref - got).abs().max() <= 1e-4


def test_build_lora_engine_matches_peft_merged_logits(tmp_path):
    from enginesmith.builder.engine import BuildConfig, build
    from enginesmith.core.engine_dir import read_manifest
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    merged = _adapter("llama", tmp_path / "adapter")
    config = BuildConfig(model="tiny:llama", lora=str(tmp_path / "adapter"))
    assert config.key("0" * 64) != BuildConfig(model="tiny:llama").key("0" * 64)
    out = build(config, tmp_path / "engine", progress=False)
    assert read_manifest(out).raw["lora"]["modules"] == 8
    engine = OrtEngine(out / "model.onnx", device="cpu")
    ids = IDS.numpy()
    logits = engine.forward(ids, np.ones_like(ids), np.arange(ids.shape[1])[None], engine.new_cache(1))
    with torch.no_grad():
        ref = merged(IDS).logits.numpy()
    assert np.abs(logits - ref).max() <= 1e-3


def test_untrusted_adapters_are_refused(tmp_path):
    good = tmp_path / "good"
    _adapter("llama", good)
    cfg = json.loads((good / "adapter_config.json").read_text())

    def variant(name, config=None, weights=None):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text(json.dumps(cfg if config is None else config))
        if weights is not None:
            (d / "adapter_model.safetensors").write_bytes(weights)
        else:
            os.link(good / "adapter_model.safetensors", d / "adapter_model.safetensors")
        return d

    raw = (good / "adapter_model.safetensors").read_bytes()
    cases = {
        "dora": (variant("dora", {**cfg, "use_dora": True}), "DoRA"),
        "prefix": (variant("prefix", {**cfg, "peft_type": "PREFIX_TUNING"}), "LORA"),
        "regex": (variant("regex", {**cfg, "alpha_pattern": {"q_pr.*": 4}}), "literal"),
        "header": (variant("header", weights=(10**12).to_bytes(8, "little") + raw[8:]), "header claims"),
        "truncated": (variant("truncated", weights=raw[: len(raw) // 2]), "inside the file"),
    }
    for name, (folder, words) in cases.items():
        with pytest.raises(UserError, match=words) as err:
            read_adapter(folder)
        assert err.value.fix, name
    link = tmp_path / "link"
    link.mkdir()
    (link / "adapter_config.json").write_text(json.dumps(cfg))
    (link / "adapter_model.safetensors").symlink_to(good / "adapter_model.safetensors")
    with pytest.raises(UserError, match="not a regular file"):
        read_adapter(link)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text(json.dumps(cfg))
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(UserError, match="safetensors"):
        read_adapter(pickled)
    with pytest.raises(UserError, match="trained on this base model"):
        fold_lora(load("tiny:gpt2").model, read_adapter(good))        # a llama adapter on GPT-2
