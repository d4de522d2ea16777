"""fp16 and bf16 engines: fp16 runs on ORT CPU close to the fp32 PyTorch model; bf16 is CUDA-only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginesmith.builder.engine import BuildConfig, cached_engine
from enginesmith.core.errors import EngineError
from enginesmith.models import load as models
from enginesmith.runtime.load import open_engine
from helpers.parity import ort_greedy, torch_greedy


def test_fp16_engine_tracks_fp32_pytorch():
    model = models.load("tiny:llama").model
    loaded = open_engine(cached_engine(BuildConfig(model="tiny:llama", dtype="fp16"), progress=False), device="cpu")
    assert loaded.engine.kv_dtype == np.float16
    ids = np.random.default_rng(0).integers(3, loaded.engine.vocab, (1, 12))
    mask = np.ones_like(ids)
    got = loaded.engine.forward(ids, mask, np.arange(12)[None], loaded.engine.new_cache(1))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    assert np.abs(got - ref).max() < 2e-2  # fp16 rounding of weights and activations
    assert ort_greedy(loaded.engine, [ids[0].tolist()], 16)[0] == torch_greedy(model, ids[0].tolist(), 16)


def test_bf16_engine_is_refused_on_cpu_with_a_fix():
    path = cached_engine(BuildConfig(model="tiny:llama", dtype="bf16"), progress=False)
    with pytest.raises(EngineError, match="bf16.*--device cuda"):
        open_engine(path, device="cpu")
