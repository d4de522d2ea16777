"""`eval ppl`'s protocols (issue 30): `harness` (lm-evaluation-harness's rolling windows with a prefix
token, the default) against a plain torch loop over transformers; `windows` (before session 14)
against the numbers the code gave before the protocols existed; the prefix token's choice."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.measure import perplexity as P

# Before session 14 (the code had one protocol), on this machine: tiny:llama (seed 0) in PyTorch on
# np.random.default_rng(0).integers(0, 49152, 300), window 96 -> {stride: (nll, tokens, windows)} ...
OLD_TORCH = {None: (11.01894404399477, 296, 4), 48: (11.057141178549582, 299, 6)}
# ... and `eval ppl --model tiny:llama --tokens 600 --window 200 --json` (Pride and Prejudice)
OLD_CLI = {"nll": 10.921759737479569, "tokens": 597, "windows": 3}


@pytest.mark.parametrize("n, window, stride", [(8, 4, 4), (10, 4, 4), (4, 4, 4), (11, 5, 3), (7, 7, 1),
                                               (9, 2, 1), (4096, 1024, 1024), (4096, 1024, 512), (300, 96, 40)])
def test_harness_spans_score_every_token_once(n, window, stride):
    plan = P.harness_spans(n, window, stride)
    scored = [t for _, end, first in plan for t in range(first, end)]
    assert scored == list(range(1, n + 1))  # text token i sits at position i + 1, after the prefix
    assert plan[0][0] == 0 and plan[0][2] == 1  # the first window reads the prefix, scores the first token
    for k, (begin, end, first) in enumerate(plan):
        assert end - 1 - begin == window  # every window reads a full window (n >= window)
        assert begin < first and (k == 0 or begin >= 1)  # context >= 1 token; the prefix in window 0 only
        assert k == 0 or end - first <= stride


def test_harness_spans_examples():
    # [p t0 t1 t2] scores t0..t3; [t3 t4 t5 t6] scores t4..t7 (lm-eval: disjoint, context_len=1)
    assert P.harness_spans(8, 4, 4) == [(0, 5, 1), (4, 9, 5)]
    # the last, partial window reads the full window before its targets t8 t9
    assert P.harness_spans(10, 4, 4) == [(0, 5, 1), (4, 9, 5), (6, 11, 9)]


def _repeat_model(calls, vocab=3):
    """Logits favour repeating the current token by 2 nats: p(same) = e^2/(e^2+vocab-1)."""
    def fn(ids):
        calls.append(ids[0].tolist())
        logits = np.zeros(ids.shape + (vocab,), dtype=np.float32)
        np.put_along_axis(logits, np.minimum(ids, vocab - 1)[..., None], 2.0, axis=-1)
        return logits
    return fn


def test_harness_against_hand_computed_reference():
    same, other = -math.log(math.e**2 / (math.e**2 + 2)), -math.log(1 / (math.e**2 + 2))
    calls = []
    r = P.perplexity(_repeat_model(calls), [0, 0, 1, 1, 1, 2, 0, 0], window=4, progress=False,
                     protocol="harness", prefix_token=2)
    # t0|p other, t1|t0 same, t2 other, t3 same | t4|t3 same, t5 other, t6 other, t7 same
    assert calls == [[2, 0, 0, 1], [1, 1, 2, 0]]
    assert r["tokens"] == 8 and r["windows"] == 2 and r["protocol"] == "harness" and r["prefix_token_id"] == 2
    assert r["nll"] == pytest.approx((4 * same + 4 * other) / 8, rel=1e-12)
    uniform = P.perplexity(lambda ids: np.zeros(ids.shape + (50,), np.float32), np.arange(40) % 50, window=10,
                           stride=7, progress=False, protocol="harness", prefix_token=0)
    assert uniform["ppl"] == pytest.approx(50.0, rel=1e-12) and uniform["tokens"] == 40 and uniform["stride"] == 7


@pytest.mark.parametrize("kwargs, match", [
    (dict(protocol="rolling", prefix_token=0), "unknown perplexity protocol"),
    (dict(protocol="harness"), "prefix token"),
    (dict(protocol="harness", prefix_token=-1), "prefix token"),
    (dict(protocol="harness", prefix_token=3), "vocabulary"),  # the prefix is outside the vocabulary
])
def test_harness_bad_inputs(kwargs, match):
    with pytest.raises(UserError, match=match) as err:
        P.perplexity(_repeat_model([]), [0, 1, 2, 1, 0], window=4, progress=False, **kwargs)
    assert err.value.fix


# ----------------------------------------------------------------------------- the prefix token

def _bos_adding_tokenizer():
    from tokenizers import processors

    from enginesmith.models import random_tokenizer

    tok = random_tokenizer.build(400)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    return tok


def test_prefix_is_bos_where_the_tokenizer_adds_one(tmp_path):
    from enginesmith.models import random_tokenizer
    from enginesmith.runtime.text.tokenizer import Tokenizer

    tok = _bos_adding_tokenizer()
    assert tok("ab")["input_ids"][0] == 1
    assert P.prefix_token(tok) == (1, "bos", "<|im_start|>")
    tok.save_pretrained(tmp_path)  # the engine's own tokenizer class (runtime.text.tokenizer), same files
    assert P.prefix_token(Tokenizer(tmp_path)) == (1, "bos", "<|im_start|>")
    # SmolLM2's layout: a BOS is defined but never added -> EOS, as the harness's EOT
    assert P.prefix_token(random_tokenizer.build(400)) == (2, "eos", "<|im_end|>")


def test_prefix_needs_bos_or_eos():
    class Bare:
        bos_token_id = eos_token_id = None

    with pytest.raises(UserError, match="no EOS") as err:
        P.prefix_token(Bare())
    assert "--protocol windows" in err.value.fix


# ----------------------------------------------------------------------------- a real model

@pytest.fixture(scope="module")
def tiny_llama(tiny_engine):
    """tiny:llama in PyTorch and the cached ORT engine built from the same weights."""
    from enginesmith.models import tiny
    from enginesmith.runtime.engines.ort_engine import OrtEngine

    return tiny.build("tiny:llama"), OrtEngine(tiny_engine("llama") / "model.onnx", device="cpu")


def _torch_rolling_nll(model, text: list[int], prefix: int, window: int, stride: int) -> tuple[float, list[int]]:
    """lm-evaluation-harness's loglikelihood_rolling written out: (context, continuation) pairs
    ([prefix], text[:window]), then (text[:s], text[s:s+stride]) ...; each pair's input is
    (context + continuation)[-(window+1):][:-1], its last len(continuation) logits score the
    continuation. Returns the summed NLL (float64 log-softmax) and the text positions scored."""
    import torch

    pairs, done = [([prefix], list(range(min(window, len(text)))))], min(window, len(text))
    while done < len(text):
        pairs.append((text[:done], list(range(done, min(done + stride, len(text))))))
        done = pairs[-1][1][-1] + 1
    total, scored = 0.0, []
    for context, positions in pairs:
        inputs = (context + [text[i] for i in positions])[-(window + 1):][:-1]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([inputs])).logits[0].double()
        logp = torch.log_softmax(logits[-len(positions):], dim=-1)
        total -= float(logp[torch.arange(len(positions)), torch.tensor([text[i] for i in positions])].sum())
        scored += positions
    return total, scored


@pytest.mark.parametrize("stride", [None, 40])
def test_engine_harness_equals_a_torch_loop(tiny_llama, stride):
    model, engine = tiny_llama
    text = np.random.default_rng(1).integers(3, model.config.vocab_size, 300)
    ours = P.perplexity(P.ort_logits_fn(engine), text, window=96, stride=stride, progress=False,
                        protocol="harness", prefix_token=1)
    total, scored = _torch_rolling_nll(model, text.tolist(), 1, 96, stride or 96)
    assert scored == list(range(300))  # every token once, the first one too
    assert ours["tokens"] == 300 and ours["windows"] == (4 if stride is None else 7)
    assert ours["nll"] * ours["tokens"] == pytest.approx(total, rel=1e-5)


@pytest.mark.parametrize("stride", [None, 48])
def test_windows_protocol_reproduces_the_old_numbers(tiny_llama, stride):
    model, _ = tiny_llama
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, 300)
    r = P.perplexity(P.torch_logits_fn(model), ids, window=96, stride=stride, progress=False, protocol="windows")
    assert (r["tokens"], r["windows"], r["prefix_token_id"]) == (*OLD_TORCH[stride][1:], None)
    assert r["nll"] == pytest.approx(OLD_TORCH[stride][0], rel=1e-6)


def test_cli_names_the_protocol(capsys, austen):
    """eval ppl: harness by default with EOS as the prefix for the random tokenizer (it adds no BOS);
    --protocol windows gives the old figure; the JSON and the printed line name both."""
    from enginesmith.cli import main

    base = ["eval", "ppl", "--model", "tiny:llama", "--tokens", "600", "--window", "200"]
    assert main(base + ["--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (r["protocol"], r["tokens"], r["windows"], r["window"], r["stride"]) == ("harness", 600, 3, 200, 200)
    assert (r["prefix_token_id"], r["prefix_token"], r["prefix_from"]) == (2, "<|im_end|>", "eos")
    assert main(base + ["--protocol", "windows", "--json"]) == 0
    old = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert old["protocol"] == "windows" and old["prefix_token_id"] is None and old["prefix_from"] is None
    assert (old["tokens"], old["windows"]) == (OLD_CLI["tokens"], OLD_CLI["windows"])
    assert old["nll"] == pytest.approx(OLD_CLI["nll"], rel=1e-6)
    from enginesmith.measure.report import format_ppl  # the printed line (without --json)

    assert "protocol harness: 3 windows of 200, stride 200, prefix token EOS '<|im_end|>' (id 2)" in format_ppl(r)
    assert "protocol windows: 3 windows of 200, stride 200, no prefix token" in format_ppl(old)
