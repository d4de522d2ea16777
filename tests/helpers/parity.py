"""The export oracles: greedy tokens from the PyTorch model (its own cache) and from an ONNX engine, the
logits tolerance, and random prompts."""

from __future__ import annotations

import numpy as np
import torch

from enginesmith.export import adapter
from enginesmith.runtime.decoding.generate import GenerationConfig, generate_ids


TOL = 1e-3


@torch.no_grad()
def torch_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    pos = torch.arange(len(prompt))[None]
    out = adapter.forward(model, ids, mask, pos, adapter.make_cache(model.config, []))
    tokens = []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones(1, 1, dtype=mask.dtype)], 1)
        pos = pos[:, -1:] + 1
        out = adapter.forward(model, torch.tensor([[nxt]]), mask, pos, adapter.output_cache(out))
    return tokens


def ort_greedy(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    steps = [ids for ids, _ in generate_ids(engine, prompts, GenerationConfig(max_new_tokens=n))]
    return np.stack(steps, 1).tolist()


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, 11).tolist(), rng.integers(3, vocab, 6).tolist()]
