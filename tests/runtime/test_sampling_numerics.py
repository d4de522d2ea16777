"""Tiny but legal sampling values (issue 28): the distribution is checked against an arbitrary-precision
reference (mpmath), never NaN, and a near-zero temperature picks the greedy token, on the host
(runtime.decoding.sampling) and on the device path (runtime.engines.ort_cuda.sample_on_device, run on CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.external import require_module

from enginesmith import cli
from enginesmith.runtime.decoding.sampling import SamplingParams, probabilities, sample

mpmath = require_module("mpmath", "pip install mpmath (a sympy dependency)")
mpmath.mp.dps = 60

TEMPERATURES = [5e-324, 1e-300, 1e-39, 1e-12, 1e-6, 0.3, 1.0, 7.0, 1e300]
PENALTIES = [5e-324, 1e-300, 1e-39, 0.5, 1.3, 1e39, 1e300]


def reference(logits: np.ndarray, temperature: float, penalty: float = 1.0, seen=()) -> np.ndarray:
    """softmax(penalized logits / T) of one row in 60-digit arithmetic, rounded to float64."""
    values = [mpmath.mpf(float(v)) for v in logits]
    for i in set(seen):
        values[i] = values[i] / penalty if values[i] > 0 else values[i] * penalty
    top = max(values)
    weights = [mpmath.exp((v - top) / mpmath.mpf(temperature)) for v in values]
    total = mpmath.fsum(weights)
    return np.array([float(w / total) for w in weights])


def rows(count: int = 4, vocab: int = 50) -> np.ndarray:
    rng = np.random.default_rng(28)
    logits = (rng.standard_normal((count, vocab)) * 4).astype(np.float32)
    logits[1, 7] = logits[1, 3]  # an exact tie for some rows' ranks
    logits[2] = np.round(logits[2])  # many ties
    return logits


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_temperature_matches_the_reference(temperature):
    logits = rows()
    got = probabilities(logits, SamplingParams(temperature=temperature))
    assert np.isfinite(got).all()
    for row in range(len(logits)):
        np.testing.assert_allclose(got[row], reference(logits[row], temperature), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("penalty", PENALTIES)
@pytest.mark.parametrize("temperature", [1e-39, 1.0])
def test_repetition_penalty_matches_the_reference(penalty, temperature):
    logits = rows()
    seen = [np.array([0, 3, 5, 7, 11]), np.array([1, 2]), np.arange(50), np.array([], dtype=np.int64)]
    got = probabilities(logits, SamplingParams(temperature=temperature, repetition_penalty=penalty), seen)
    assert np.isfinite(got).all() and np.allclose(got.sum(-1), 1.0)
    for row in range(len(logits)):
        want = reference(logits[row], temperature, penalty, seen[row].tolist())
        if penalty < 1e-300:  # |logit| / penalty overflows float64: clipped, the overflowed tokens tie
            overflowed = [i for i in set(seen[row].tolist()) if logits[row, i] > 0]
            assert got[row][overflowed].sum() == pytest.approx(1.0) if overflowed else np.allclose(got[row], want)
            continue
        np.testing.assert_allclose(got[row], want, rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-39, 0.5])
def test_tiny_top_p_keeps_the_best_token(top_p):
    logits = rows()
    for temperature in (1e-39, 1.0):
        got = probabilities(logits, SamplingParams(temperature=temperature, top_p=top_p))
        assert np.isfinite(got).all()
        if top_p < 1e-30:
            assert (got.argmax(-1) == logits.argmax(-1)).all() and (got.max(-1) == 1.0).all()


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-39, 1e-20])
def test_near_zero_temperature_is_greedy(temperature):
    logits = rows()
    logits[2, 0] = logits[2].max() + 1  # no tie at the top of any row
    logits[1, 0] = logits[1].max() + 0.5
    rng = np.random.default_rng(0)
    greedy = sample(logits, SamplingParams(), rng)
    for _ in range(20):
        assert (sample(logits, SamplingParams(temperature=temperature), rng) == greedy).all()


@pytest.mark.parametrize("temperature", [1e-46, 1e-39, 1e-20])
def test_the_device_path_is_greedy_at_near_zero_temperature(temperature):
    torch = pytest.importorskip("torch")
    from enginesmith.runtime.engines.ort_cuda import sample_on_device

    logits = torch.from_numpy(rows())
    logits[:, 0] = logits.max(-1).values + 0.25
    generator = torch.Generator().manual_seed(1)
    for params in (SamplingParams(temperature=temperature), SamplingParams(temperature=temperature, top_p=1e-300),
                   SamplingParams(temperature=temperature, top_k=3)):
        ids = sample_on_device(logits, params, generator)
        assert ids.tolist() == [0] * len(logits)


def test_the_device_path_survives_a_tiny_penalty():
    torch = pytest.importorskip("torch")
    from enginesmith.runtime.engines.ort_cuda import sample_on_device

    logits = torch.tensor([[1.0, 3.0, 2.0, -1.0]])
    seen = torch.tensor([[True, False, True, True]])
    generator = torch.Generator().manual_seed(2)
    drawn = {int(sample_on_device(logits, SamplingParams(temperature=1.0, repetition_penalty=5e-324),
                                  generator, seen)[0]) for _ in range(40)}
    assert drawn <= {0, 2} and drawn  # the seen positive logits overflow and tie; never a NaN's token 0 alone


def test_run_with_a_tiny_temperature_prints_the_greedy_text(tiny_engine, capfd):
    engine = str(tiny_engine("llama"))
    base = ["run", "--engine", engine, "--device", "cpu", "--raw", "Once upon", "--max-tokens", "6"]
    assert cli.main(base) == 0
    greedy = capfd.readouterr().out
    for value in ("1e-39", "5e-324", "1e-300"):
        assert cli.main(base + ["--temperature", value, "--seed", "3"]) == 0
        assert capfd.readouterr().out == greedy
