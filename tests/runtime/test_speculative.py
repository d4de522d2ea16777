"""Speculative decoding: lossless greedy, the target's distribution under sampling, rollback, errors.

Statistical tests: a chi-square goodness-of-fit test of speculative samples against the target's
exact distribution over whole continuations (computed by enumeration), seeded, each at a
false-alarm rate of alpha = 1e-3 (all of this file's four tests together: <= 0.4 %, Bonferroni).
A power check shows the same test rejects samples of the draft model alone.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding import speculative as sp
from enginesmith.runtime.load import open_drafter
from enginesmith.runtime.decoding.generate import GenerationConfig, generate, generate_ids
from enginesmith.runtime.decoding.sampling import SamplingParams, probabilities

ALPHA = 1e-3


# ----------------------------------------------------------------------------- a toy LM in numpy

class ToyCache:
    rollback = True  # protocols.KVCache
    evicts = False

    def __init__(self):
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]


class ToyLM:
    """Next-token logits are a random function of the last two tokens (a trigram table)."""

    device, device_decode = "cpu", False  # protocols.Engine

    def __init__(self, vocab: int, seed: int, scale: float = 1.5):
        self.vocab = vocab
        self.table = np.random.default_rng(seed).normal(0.0, scale, (vocab, vocab, vocab)).astype(np.float32)
        self.calls = 0

    def new_cache(self, batch: int) -> ToyCache:
        return ToyCache()

    def logits_after(self, tokens) -> np.ndarray:
        return self.table[tokens[-2] if len(tokens) > 1 else 0, tokens[-1]]

    def forward(self, ids, mask, pos, cache: ToyCache) -> np.ndarray:
        assert mask.shape[1] == cache.length + ids.shape[1], "the loop fed a mask that does not match its cache"
        assert pos[0, 0] == cache.length
        self.calls += 1
        out = []
        for t in ids[0].tolist():
            cache.tokens.append(t)
            out.append(self.logits_after(cache.tokens))
        return np.stack(out)[None]


def exact_distribution(lm: ToyLM, prompt: list[int], new: int, params: SamplingParams) -> dict[tuple, float]:
    """P(continuation) under plain sampling, by enumeration."""
    dist: dict[tuple, float] = {}
    for seq in itertools.product(range(lm.vocab), repeat=new):
        p, context = 1.0, list(prompt)
        for t in seq:
            seen = [np.array(context)] if params.repetition_penalty != 1.0 else None
            p *= float(probabilities(lm.logits_after(context)[None], params, seen)[0, t])
            context.append(t)
            if p == 0.0:
                break
        if p > 0:
            dist[seq] = p
    return dist


def chi_square_p(samples: list[tuple], dist: dict[tuple, float]) -> float:
    """p-value of a chi-square goodness-of-fit test; bins with expected count < 5 are pooled."""
    n = len(samples)
    counts: dict[tuple, int] = {}
    for s in samples:
        assert s in dist, f"sampled {s}, which has probability 0 under the target"
        counts[s] = counts.get(s, 0) + 1
    big = [s for s, p in dist.items() if n * p >= 5]
    observed = [counts.get(s, 0) for s in big]
    expected = [n * dist[s] for s in big]
    rest_obs, rest_exp = n - sum(observed), n - sum(expected)
    if rest_exp > 1e-9:
        observed.append(rest_obs)
        expected.append(rest_exp)
    obs, exp = np.array(observed, float), np.array(expected, float)
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def speculative_samples(target, drafter, prompt, new, params, k, n):
    out = []
    for seed in range(n):
        config = GenerationConfig(max_new_tokens=new, sampling=SamplingParams(
            temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
            repetition_penalty=params.repetition_penalty, seed=seed))
        out.append(tuple(sp.speculative_tokens(target, drafter, prompt, config, sp.SpeculativeConfig(k=k))))
    return out


@pytest.mark.parametrize("drafter, params", [
    ("model", SamplingParams(temperature=1.0)),
    ("model", SamplingParams(temperature=0.7, top_k=3, top_p=0.9, repetition_penalty=1.3)),
    ("ngram", SamplingParams(temperature=1.0, top_k=3)),
], ids=["draft-model", "draft-model-processors", "ngram"])
def test_sampling_keeps_the_target_distribution(drafter, params):
    target, draft = ToyLM(4, seed=1), ToyLM(4, seed=2)
    prompt = [0, 1, 2, 0, 1, 2, 0, 1]  # repeats, so prompt lookup finds drafts
    new = 4
    d = sp.ModelDrafter(draft) if drafter == "model" else sp.NgramDrafter()
    samples = speculative_samples(target, d, prompt, new, params, k=2, n=3000)
    dist = exact_distribution(target, prompt, new, params)
    assert chi_square_p(samples, dist) > ALPHA
    if params.top_k == 0:  # power: the same test tells the draft model's own samples from the target's
        draft_samples = speculative_samples(draft, sp.NgramDrafter(min_ngram=9, max_ngram=9), prompt, new,
                                            params, k=1, n=3000)
        assert chi_square_p(draft_samples, dist) < 1e-6


def test_sampling_on_a_tiny_onnx_model(tiny_engine):
    """The same test on ONNX Runtime engines: tiny llama target, tiny qwen2 draft (same vocab)."""
    from enginesmith.runtime.load import open_engine

    target = open_engine(tiny_engine("llama"), device="cpu", threads=1).engine
    draft = open_engine(tiny_engine("qwen2"), device="cpu", threads=1).engine
    prompt = [5, 17, 300, 5, 17]
    params = SamplingParams(temperature=1.0, top_k=2)
    new = 3

    def probs_after(context):
        cache = target.new_cache(1)
        ids = np.array([context])
        logits = target.forward(ids, np.ones_like(ids), np.arange(len(context))[None], cache)[0, -1]
        return probabilities(logits[None], params)[0]

    dist: dict[tuple, float] = {}
    for first in np.flatnonzero(probs_after(prompt)):
        for second in np.flatnonzero(probs_after(prompt + [int(first)])):
            p3 = probs_after(prompt + [int(first), int(second)])
            for third in np.flatnonzero(p3):
                seq = (int(first), int(second), int(third))
                dist[seq] = float(probs_after(prompt)[first] * probs_after(prompt + [int(first)])[second] * p3[third])
    samples = speculative_samples(target, sp.ModelDrafter(draft), prompt, new, params, k=2, n=250)
    assert chi_square_p(samples, dist) > ALPHA


# ----------------------------------------------------------------------------- greedy is lossless

class PartlyWrongDrafter(sp.ModelDrafter):
    """The target itself as draft, with its middle draft token changed: partial acceptance."""

    def propose(self, context, k, params, rng, stats):
        tokens, qs = super().propose(context, k, params, rng, stats)
        if len(tokens) > 1:
            tokens[len(tokens) // 2] = (tokens[len(tokens) // 2] + 1) % self.vocab
        return tokens, qs


def test_greedy_is_token_identical_over_60_prompts(tiny_engine):
    from enginesmith.runtime.load import open_engine

    target = open_engine(tiny_engine("llama"), device="cpu", threads=1).engine
    draft = open_engine(tiny_engine("qwen2"), device="cpu", threads=1).engine
    rng = np.random.default_rng(0)
    config = GenerationConfig(max_new_tokens=16)
    stats = {"ngram": sp.SpeculativeStats(), "model": sp.SpeculativeStats()}
    for i in range(60):
        base = rng.integers(0, target.vocab, int(rng.integers(3, 12))).tolist()
        prompt = base + base[: len(base) // 2]
        plain = [int(ids[0]) for ids, _ in generate_ids(target, [prompt], config)]
        kind = "ngram" if i % 2 else "model"
        drafter = sp.NgramDrafter() if kind == "ngram" else \
            sp.ModelDrafter(draft) if i % 4 == 0 else PartlyWrongDrafter(target)
        spec = sp.SpeculativeConfig(k=1 + i % 5, adaptive=i % 3 != 0)
        assert list(sp.speculative_tokens(target, drafter, prompt, config, spec, stats[kind])) == plain, i
    for s in stats.values():  # both drafters got drafts accepted and rejected, so rollback ran
        assert 0 < s.accepted < s.proposed
        assert s.tokens_per_target_call > 1.0


def test_greedy_stop_tokens_budget_and_batches(tiny_engine):
    """generate() with a SpeculativeDecoder returns what plain generate() returns, stops included."""
    from enginesmith.runtime.load import open_engine

    loaded = open_engine(tiny_engine("llama"), device="cpu", threads=1)
    target = loaded.engine
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11, 12]]
    probe = [int(ids[0]) for ids, _ in generate_ids(target, [prompts[0]], GenerationConfig(max_new_tokens=12))]
    config = GenerationConfig(max_new_tokens=12, stop_token_ids=(probe[5],), max_positions=512)
    plain = generate(target, loaded.tokenizer, prompts, config)
    decoder = sp.SpeculativeDecoder(sp.NgramDrafter(), sp.SpeculativeConfig(k=3))
    spec = generate(target, loaded.tokenizer, prompts, config, decoder=decoder)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert [c.finish_reason for c in spec] == [c.finish_reason for c in plain]
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == probe[5]
    assert decoder.stats.target_calls >= 2 and decoder.stats.new_tokens == sum(len(c.token_ids) for c in spec)


def test_toy_greedy_matches_and_counts():
    target = ToyLM(5, seed=3)
    config = GenerationConfig(max_new_tokens=30)
    prompt = [1, 2, 3, 1, 2]
    plain = [int(ids[0]) for ids, _ in generate_ids(target, [prompt], config)]
    stats = sp.SpeculativeStats()
    out = list(sp.speculative_tokens(target, sp.ModelDrafter(target), prompt, config, sp.SpeculativeConfig(k=4), stats))
    assert out == plain
    assert stats.acceptance_rate == 1.0  # a draft identical to the target is always right
    assert stats.tokens_per_target_call > 3.0


def test_dense_cache_truncate_rolls_back(tiny_engine):
    from enginesmith.runtime.load import open_engine

    engine = open_engine(tiny_engine("llama"), device="cpu", threads=1).engine
    ids = np.array([[3, 4, 5, 6, 7, 8]])
    cache = engine.new_cache(1)
    engine.forward(ids, np.ones_like(ids), np.arange(6)[None], cache)
    cache.truncate(4)
    assert cache.length == 4
    again = engine.forward(ids[:, 4:], np.ones((1, 6), np.int64), np.arange(4, 6)[None], cache)
    fresh_cache = engine.new_cache(1)
    fresh = engine.forward(ids, np.ones_like(ids), np.arange(6)[None], fresh_cache)
    np.testing.assert_allclose(again[0], fresh[0, 4:], atol=1e-4)


def test_ngram_drafter_proposes_the_latest_continuation():
    d = sp.NgramDrafter(max_ngram=2)
    ctx = np.array([1, 2, 3, 9, 1, 2, 4, 5, 1, 2])
    tokens, q = d.propose(ctx, 3, SamplingParams(), None, sp.SpeculativeStats())
    assert tokens == [4, 5, 1] and q is None
    assert d.propose(np.array([7, 8, 9]), 3, SamplingParams(), None, sp.SpeculativeStats())[0] == []


# ----------------------------------------------------------------------------- bad input

def test_bad_input_is_a_user_error():
    with pytest.raises(UserError, match="k=0"):
        sp.SpeculativeConfig(k=0)
    with pytest.raises(UserError, match="k=-2"):
        sp.SpeculativeConfig(k=-2)
    with pytest.raises(UserError, match="n-gram"):
        sp.SpeculativeConfig(min_ngram=3, max_ngram=2)
    target, small = ToyLM(5, seed=0), ToyLM(6, seed=0)
    with pytest.raises(UserError, match="vocabulary"):
        list(sp.speculative_tokens(target, sp.ModelDrafter(small), [1, 2], GenerationConfig(max_new_tokens=3),
                                   sp.SpeculativeConfig()))
    with pytest.raises(UserError, match="speculative mode"):
        open_drafter("bogus", 5)

    class Tok:
        def __init__(self, shift):
            self.shift = shift

        def __len__(self):
            return 5

        def encode(self, text, add_special_tokens=True):
            return [(ord(c) + self.shift) % 5 for c in text]

    with pytest.raises(UserError, match="tokenizer"):
        sp.check_compatible(5, 5, Tok(0), Tok(1))
    sp.check_compatible(5, 5, Tok(2), Tok(2))

    class NoRollback(ToyLM):
        def new_cache(self, batch):
            cache = ToyCache()
            cache.rollback = False
            return cache

    with pytest.raises(UserError, match="rollback"):
        list(sp.speculative_tokens(NoRollback(5, 0), sp.NgramDrafter(), [1, 2], GenerationConfig(max_new_tokens=3),
                                   sp.SpeculativeConfig()))


def test_open_drafter_refuses_a_draft_with_another_vocabulary(tiny_engine, tmp_path):
    """A draft engine whose vocabulary differs from the target's is refused before decoding."""
    with pytest.raises(UserError, match="vocabulary"):
        open_drafter(f"draft:{tiny_engine('llama')}", target_vocab=1000)


# ----------------------------------------------------------------------------- the CLI

def test_cli_run_and_bench_with_speculation(tiny_engine, capsys):
    from enginesmith.cli import main

    engine = str(tiny_engine("llama"))
    assert main(["run", "--engine", engine, "--device", "cpu", "--speculative", "ngram", "--k", "3",
                 "--max-tokens", "10", "--raw", "the cat the cat the"]) == 0
    assert "[speculative]" in capsys.readouterr().err
    assert main(["bench", "--engine", engine, "--device", "cpu", "--speculative", "ngram", "--new-tokens", "12",
                 "--prompt-tokens", "16", "--repeats", "1", "--json"]) == 0
    import json

    result = json.loads(capsys.readouterr().out)
    assert result["speculative"]["identical"] and result["speculative"]["target_calls"] >= 1


@pytest.mark.parametrize("flags, message", [
    (["--speculative", "ngram", "--k", "0"], "invalid speculative k=0"),
    (["--speculative", "ngram", "--k", "-1"], "invalid speculative k=-1"),
    (["--speculative", "bogus"], "unknown --speculative mode"),
])
def test_cli_bad_speculative_flags(flags, message, capsys):
    """Refused before any model is loaded: one line, exit code 2."""
    from enginesmith.cli import main

    assert main(["run", "--model", "tiny:llama", *flags, "hi"]) == 2
    assert message in capsys.readouterr().err
