"""ONNX (ORT CPU) against the PyTorch model it was exported from: logits and greedy tokens.

Oracle: the fp32 transformers model, run with its own cache. Every supported family (tiny random
weights) plus the real SmolLM2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from enginesmith.export import adapter
from enginesmith.models import load as models
from enginesmith.runtime.decoding.generate import left_pad, positions
from enginesmith.runtime.load import open_engine
from helpers.parity import TOL, _prompts, ort_greedy, torch_greedy
from helpers.tiny_families import FAMILIES


def _cases():
    return [pytest.param(f, id=f) for f in FAMILIES] + [pytest.param("smollm2", id="smollm2", marks=pytest.mark.slow)]


@pytest.fixture(scope="module")
def pair(request, tiny_engine):
    """(torch model, LoadedEngine) for one case."""
    name = request.param
    if name == "smollm2":
        model = request.getfixturevalue("smollm2").model
        path = request.getfixturevalue("smollm2_engine")
    else:
        model = models.load(f"tiny:{name}").model
        path = tiny_engine(name)
    return model, open_engine(path, device="cpu")


@pytest.mark.parametrize("pair", _cases(), indirect=True)
def test_prefill_and_decode_logits_match(pair):
    model, loaded = pair
    prompt = _prompts(loaded.engine.vocab)[0]
    cache = loaded.engine.new_cache(1)
    ids = np.array([prompt])
    mask = np.ones_like(ids)
    got = loaded.engine.forward(ids, mask, positions(mask, ids.shape[1]), cache)
    with torch.no_grad():
        ref_out = adapter.forward(model, torch.tensor(ids), torch.tensor(mask),
                                  torch.tensor(positions(mask, ids.shape[1])), adapter.make_cache(model.config, []))
    assert np.abs(got - ref_out.logits.numpy()).max() <= TOL
    # three decode steps against the torch cache
    ref_cache = adapter.output_cache(ref_out)
    for step in range(3):
        nxt = np.array([[int(got[0, -1].argmax())]])
        mask = np.concatenate([mask, [[1]]], 1)
        pos = positions(mask, 1)
        got = loaded.engine.forward(nxt, mask, pos, cache)
        with torch.no_grad():
            ref_out = adapter.forward(model, torch.tensor(nxt), torch.tensor(mask), torch.tensor(pos), ref_cache)
        ref_cache = adapter.output_cache(ref_out)
        assert np.abs(got - ref_out.logits.numpy()).max() <= TOL, f"decode step {step}"
    assert cache.length == len(prompt) + 3


@pytest.mark.parametrize("pair", _cases(), indirect=True)
def test_64_greedy_tokens_identical(pair):
    model, loaded = pair
    prompt = _prompts(loaded.engine.vocab, seed=1)[0]
    assert ort_greedy(loaded.engine, [prompt], 64)[0] == torch_greedy(model, prompt, 64)


@pytest.mark.parametrize("pair", _cases(), indirect=True)
def test_left_padded_batch_matches_each_prompt_alone(pair):
    model, loaded = pair
    prompts = _prompts(loaded.engine.vocab, seed=2)
    assert len(prompts[0]) != len(prompts[1])  # so one row really is padded
    # logits of the padded batch equal each row run alone in torch (real positions only)
    ids, mask = left_pad(prompts, pad_id=0)
    got = loaded.engine.forward(ids, mask, positions(mask, ids.shape[1]), loaded.engine.new_cache(2))
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits.numpy()[0]
        assert np.abs(got[row, -len(prompt):] - ref).max() <= TOL
    batch = ort_greedy(loaded.engine, prompts, 24)
    for row, prompt in enumerate(prompts):
        assert batch[row] == torch_greedy(model, prompt, 24)
