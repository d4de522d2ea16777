"""Perplexity: window plans, a hand-computed reference, ORT vs torch (tiny and real SmolLM2)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.measure import perplexity as P


def test_spans_score_every_token_once():
    for n, window, stride in [(8, 4, 4), (10, 4, 4), (8, 4, 2), (4096, 1024, 512), (11, 5, 3), (7, 7, 1)]:
        plan = P.spans(n, window, stride)
        scored = [t for _, end, first in plan for t in range(first, end)]
        assert scored == list(range(1, n)) or stride == window  # sliding: all but token 0
        for begin, end, first in plan:
            assert end - begin <= window and begin < first <= end
    # non-overlapping windows never predict their first token
    assert P.spans(8, 4, 4) == [(0, 4, 1), (4, 8, 5)]
    assert P.spans(10, 4, 4) == [(0, 4, 1), (4, 8, 5), (8, 10, 9)]
    assert P.spans(8, 4, 2) == [(0, 4, 1), (2, 6, 4), (4, 8, 6)]


def _repeat_model(calls):
    """Vocab 3; logits favour repeating the current token by 2 nats: p(same) = e^2/(e^2+2)."""
    def fn(ids):
        calls.append(ids.copy())
        logits = np.zeros(ids.shape + (3,), dtype=np.float32)
        np.put_along_axis(logits, np.minimum(ids, 2)[..., None], 2.0, axis=-1)
        return logits
    return fn


def test_against_hand_computed_reference():
    same, other = -math.log(math.e**2 / (math.e**2 + 2)), -math.log(1 / (math.e**2 + 2))
    ids = [0, 0, 1, 1, 1, 2, 0, 0]
    calls = []
    # windows [0 0 1 1] [1 2 0 0]: scored 0->0 same, 0->1 other, 1->1 same | 1->2 other, 2->0 other, 0->0 same
    r = P.perplexity(_repeat_model(calls), ids, window=4, progress=False)
    assert [c.tolist() for c in calls] == [[[0, 0, 1, 1]], [[1, 2, 0, 0]]]
    assert r["tokens"] == 6 and r["windows"] == 2
    assert r["nll"] == pytest.approx((3 * same + 3 * other) / 6, rel=1e-12)
    assert r["ppl"] == pytest.approx(math.exp(r["nll"]), rel=1e-12)
    # sliding window 4 stride 2 scores tokens 1..7: same other same | same other | other same
    calls.clear()
    r = P.perplexity(_repeat_model(calls), ids, window=4, stride=2, progress=False)
    assert [c.tolist() for c in calls] == [[[0, 0, 1, 1]], [[1, 1, 1, 2]], [[1, 2, 0, 0]]]
    assert r["tokens"] == 7 and r["nll"] == pytest.approx((4 * same + 3 * other) / 7, rel=1e-12)


def test_uniform_model_has_perplexity_vocab():
    r = P.perplexity(lambda ids: np.zeros(ids.shape + (50,), np.float32), np.arange(40) % 50, window=10,
                     progress=False)
    assert r["ppl"] == pytest.approx(50.0, rel=1e-12) and r["tokens"] == 36


@pytest.mark.parametrize("kwargs, match", [
    (dict(token_ids=list(range(10)), window=1), "window"),
    (dict(token_ids=list(range(10)), window=4, stride=0), "stride"),
    (dict(token_ids=list(range(10)), window=4, stride=5), "stride"),
    (dict(token_ids=list(range(3)), window=4), "fewer than one window"),
    (dict(token_ids=[[1, 2, 3, 4]], window=4), "1-D"),
    (dict(token_ids=[0.5, 1.0, 2.0, 1.0], window=4), "integer"),
    (dict(token_ids=[1, -1, 2, 1], window=4), "negative"),
    (dict(token_ids=[1, 2, 3, 1], window=4), "vocabulary"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(UserError, match=match) as err:
        P.perplexity(_repeat_model([]), progress=False, **kwargs)
    assert err.value.fix


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from enginesmith.export.to_onnx import export
    from enginesmith.models import tiny
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    model = tiny.build("tiny:llama")
    path = export(model, tmp_path_factory.mktemp("tiny") / "model.onnx")
    return model, OrtEngine(path, device="cpu")


def test_ort_matches_torch_tiny(tiny_llama):
    model, engine = tiny_llama
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 300)
    for stride in (None, 48):
        ort = P.perplexity(P.ort_logits_fn(engine), ids, window=96, stride=stride, progress=False)
        ref = P.perplexity(P.torch_logits_fn(model), ids, window=96, stride=stride, progress=False)
        assert ort["tokens"] == ref["tokens"] == (296 if stride is None else 299)
        assert ort["ppl"] == pytest.approx(ref["ppl"], rel=1e-4)


@pytest.mark.slow
def test_smollm2_ort_matches_torch_on_austen(smollm2, smollm2_onnx, austen):
    """facts.md: SmolLM2 fp32, first 4096 tokens of Pride and Prejudice, no BOS, 1024 windows: 20.30."""
    from enginesmith.models.corpus import austen_text, tokenize
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    ids = tokenize(smollm2.tokenizer, austen_text("prideprejudice"), 4096)
    assert len(ids) == 4096
    ort = P.perplexity(P.ort_logits_fn(OrtEngine(smollm2_onnx, device="cpu")), ids, window=1024, progress=False)
    ref = P.perplexity(P.torch_logits_fn(smollm2.model), ids, window=1024, progress=False)
    assert ort["tokens"] == ref["tokens"] == 4092
    assert ref["ppl"] == pytest.approx(20.30, abs=0.01)
    assert ort["ppl"] == pytest.approx(ref["ppl"], rel=1e-3)
