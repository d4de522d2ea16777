"""A PyTorch reference of the H2O cache policy (heavy hitters + recent tokens), the oracle of the
kv_h2o tests: StartRecentReference's pos-shift attention (keys cached before RoPE, rotated by
their index in the cache every step) with H2O's eviction instead of StreamingLLM's.

Entries stay in arrival order. Each accumulates the attention it receives (float64 softmax, summed
over layers, heads and queries). When a token arrives at a full cache of `budget` entries, the
entry of least accumulated attention among those older than the `recent` newest tokens goes.
"""

from __future__ import annotations

import numpy as np
import torch
from helpers.ring_reference import StartRecentReference


class H2OReference(StartRecentReference):
    def __init__(self, model, budget: int, recent: int):
        super().__init__(model, 0, budget)
        self.budget, self.recent_kept = budget, recent
        self.arrival: list[int] = []
        self.scores = torch.zeros(0, dtype=torch.float64)
        self.seen = 0

    def evict_for_space(self, num_coming: int) -> None:
        if len(self) + num_coming <= self.budget:
            return
        assert num_coming == 1 and len(self) == self.budget, "a full H2O cache takes one token per step"
        old = torch.tensor([a < self.seen - self.recent_kept for a in self.arrival])
        victim = int(torch.where(old, self.scores, torch.inf).argmin())
        keep = [j for j in range(len(self)) if j != victim]
        self.keys = [k[:, :, keep] for k in self.keys]
        self.values = [v[:, :, keep] for v in self.values]
        self.scores = self.scores[keep]
        self.arrival = [self.arrival[j] for j in keep]

    def observe(self, probs: torch.Tensor) -> None:
        total = probs.shape[-1]
        if len(self.scores) < total:               # the first layer of a step: new entries start at 0
            self.scores = torch.cat([self.scores, torch.zeros(total - len(self.scores), dtype=torch.float64)])
        self.scores += probs.sum(dim=(0, 1, 2))

    def forward(self, ids: np.ndarray) -> np.ndarray:
        n = np.asarray(ids).shape[1]
        out = super().forward(ids)
        self.arrival += list(range(self.seen, self.seen + n))
        self.seen += n
        return out
