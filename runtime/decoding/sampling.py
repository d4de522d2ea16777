"""Turning next-token logits into token ids: greedy, temperature, top-k, top-p, repetition penalty.

All functions work on a batch: logits [B, V] float32. Randomness comes only from the
np.random.Generator passed in, so a seed reproduces a run exactly.

Numerics (issue 28: `--temperature 1e-39` gave NaN and token 0): the processors run in float64, and
temperature divides logits already shifted by their row maximum, (x - max) / T, which is the same
distribution (softmax is shift-invariant) but cannot overflow: the best logit is 0 whatever T is, the
others go to -inf as T -> 0, so a near-zero temperature is the greedy choice (among exact ties, an
even draw). A repetition penalty that overflows float64 (|logit| / penalty > 1.8e308) is clipped to
the largest finite value, so every value stays a number.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from enginesmith.core.errors import UserError

MAX_SEED = 2 ** 64  # seeds are 64-bit: numpy takes more, torch's CUDA generator does not
_FINITE = np.finfo(np.float64).max


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0        # 0 = greedy
    top_k: int = 0                  # 0 = off
    top_p: float = 1.0              # 1 = off
    repetition_penalty: float = 1.0  # 1 = off (CTRL-style: divide positive logits, multiply negative)
    seed: int | None = None

    def __post_init__(self) -> None:
        """Every value checked here, once, for every caller (CLI, Triton, batching): a UserError
        naming the value and its valid range; numpy integers are taken as ints."""
        def bad(name, value, rule):
            raise UserError(f"invalid sampling value {name}={value!r}", f"{name} must be {rule}")

        def number(value) -> bool:
            return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)

        def integer(name) -> bool:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
                return True
            return False

        if not number(self.temperature) or self.temperature < 0:
            bad("temperature", self.temperature, "a finite number >= 0 (0 = greedy)")
        if not integer("top_k") or self.top_k < 0:
            bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        if not number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if not number(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", self.repetition_penalty, "a finite number > 0 (1 = off)")
        if self.seed is not None and (not integer("seed") or not 0 <= self.seed < MAX_SEED):
            bad("seed", self.seed, "an integer in [0, 2**64 - 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def apply_repetition_penalty(logits: np.ndarray, seen: list[np.ndarray], penalty: float) -> np.ndarray:
    """Penalize tokens already in each row's context (prompt + generated); float64, finite where the
    logits were."""
    if penalty == 1.0:
        return logits
    logits = np.array(logits, dtype=np.float64)
    with np.errstate(over="ignore"):
        for row, ids in enumerate(seen):
            ids = np.unique(ids)
            values = logits[row, ids]
            penalized = np.clip(np.where(values > 0, values / penalty, values * penalty), -_FINITE, _FINITE)
            logits[row, ids] = np.where(np.isfinite(values), penalized, values)  # a masked -inf stays masked
    return logits


def apply_temperature(logits: np.ndarray, temperature: float) -> np.ndarray:
    """(logits - row max) / temperature in float64: the distribution of logits / temperature, with the
    best token at 0 for any temperature > 0 (no overflow, no inf - inf)."""
    x = np.asarray(logits, dtype=np.float64)
    top = np.max(x, axis=-1, keepdims=True)
    with np.errstate(over="ignore", invalid="ignore"):
        shifted = np.where(x == top, 0.0, (x - top) / temperature)  # -inf stays -inf
    return shifted


def filter_top_k(logits: np.ndarray, k: int) -> np.ndarray:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = np.partition(logits, -k, axis=-1)[:, -k][:, None]
    return np.where(logits < kth, -np.inf, logits)


def filter_top_p(logits: np.ndarray, p: float) -> np.ndarray:
    """Keep the smallest set of tokens whose probability mass reaches p (at least one)."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, axis=-1)
    sorted_logits = np.take_along_axis(logits, order, axis=-1)
    probs = _softmax(sorted_logits)
    mass_before = np.cumsum(probs, axis=-1) - probs
    drop_sorted = mass_before >= p
    drop = np.zeros_like(drop_sorted)
    np.put_along_axis(drop, order, drop_sorted, axis=-1)
    return np.where(drop, -np.inf, logits)


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(x)
    return e / np.sum(e, axis=-1, keepdims=True)


def probabilities(logits: np.ndarray, params: SamplingParams, seen: list[np.ndarray] | None = None) -> np.ndarray:
    """The distribution sampling draws from, after every processor ([B, V], rows sum to 1)."""
    logits = apply_repetition_penalty(logits, seen or [], params.repetition_penalty) if seen else logits
    logits = filter_top_k(apply_temperature(logits, params.temperature), params.top_k)
    return _softmax(filter_top_p(logits, params.top_p))


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           seen: list[np.ndarray] | None = None) -> np.ndarray:
    """Next token per row: [B] int64."""
    if params.greedy:
        if seen and params.repetition_penalty != 1.0:
            logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
        return np.argmax(logits, axis=-1).astype(np.int64)
    probs = probabilities(logits, params, seen)
    # Inverse-CDF draw per row (one uniform each): exact and reproducible from the seed.
    u = rng.random((probs.shape[0], 1))
    cdf = np.cumsum(probs, axis=-1)
    return np.minimum((cdf < u * cdf[:, -1:]).sum(axis=-1), probs.shape[-1] - 1).astype(np.int64)
