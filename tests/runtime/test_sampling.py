"""Sampling processors against direct numpy definitions, and seeded reproducibility."""

from __future__ import annotations

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.sampling import (SamplingParams, apply_repetition_penalty, filter_top_k,
                                          filter_top_p, probabilities, sample)


def test_greedy_is_argmax():
    logits = np.array([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]], dtype=np.float32)
    assert sample(logits, SamplingParams(), np.random.default_rng(0)).tolist() == [1, 0]


def test_top_k_keeps_k_largest():
    logits = np.array([[1.0, 4.0, 2.0, 3.0]])
    kept = np.isfinite(filter_top_k(logits, 2))
    assert kept.tolist() == [[False, True, False, True]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([[0.5, 0.3, 0.15, 0.05]])
    logits = np.log(probs)
    assert np.isfinite(filter_top_p(logits, 0.79)).tolist() == [[True, True, False, False]]
    assert np.isfinite(filter_top_p(logits, 0.81)).tolist() == [[True, True, True, False]]
    assert np.isfinite(filter_top_p(logits, 0.01)).tolist() == [[True, False, False, False]]


def test_repetition_penalty_divides_positive_multiplies_negative():
    logits = np.array([[2.0, -2.0, 1.0]])
    out = apply_repetition_penalty(logits, [np.array([0, 1, 1])], 2.0)
    assert out.tolist() == [[1.0, -4.0, 1.0]]


def test_sampling_follows_the_distribution():
    """Chi-square goodness of fit over 20k draws; p_false_alarm ~ 1e-6 at this threshold."""
    logits = np.log(np.array([[0.5, 0.25, 0.15, 0.1]]))
    params = SamplingParams(temperature=1.0, seed=3)
    rng = np.random.default_rng(params.seed)
    draws = np.concatenate([sample(np.repeat(logits, 1000, 0), params, rng) for _ in range(20)])
    counts = np.bincount(draws, minlength=4)
    expected = probabilities(logits, params)[0] * len(draws)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 30.0  # 3 d.o.f.: P(chi2 > 30) ~ 1.4e-6


def test_temperature_sharpens():
    logits = np.array([[1.0, 2.0]])
    cold = probabilities(logits, SamplingParams(temperature=0.5))[0, 1]
    hot = probabilities(logits, SamplingParams(temperature=2.0))[0, 1]
    assert cold > 1 / (1 + np.exp(-1.0)) > hot


def test_seed_reproduces():
    logits = np.random.default_rng(0).normal(size=(4, 100))
    p = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7)
    a = sample(logits, p, np.random.default_rng(p.seed))
    b = sample(logits, p, np.random.default_rng(p.seed))
    assert a.tolist() == b.tolist()


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_k=-1),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(repetition_penalty=0.0)])
def test_invalid_values_are_user_errors(kwargs):
    with pytest.raises(UserError):
        SamplingParams(**kwargs)
