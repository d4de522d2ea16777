"""The tensor-core prompt path of com.enginesmith.GroupQueryAttention (plugins/ort_ops/attention_prefill.h).

GPU only (marked gpu): the op's CPU kernel is attention.h's reference and is tested in
test_ort_attention.py. Calls with S >= 64 new tokens per row run the tensor-core kernels, shorter ones
today's kernel, unless $ES_GQA_PREFILL=0 (read per call; on by default since it was measured faster
on an H200, session 16), so one session runs both paths on the same inputs. Checked: both paths against the numpy reference (plugins/reference.py)
over head sizes 64/128/256, GQA groups 1/3/4/8, S in {1, 7, 64, 300} (both sides of the threshold),
past 0 and 100 with rows of different pasts in one call, softcap and windows on and off; 4096-token
prompts (Llama-3.2-1B's heads) against today's kernel and against the reference; keys outside a block's
range never read (NaN there); rows out of range give NaN; which kernels ran (the profiler).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from test_ort_attention import _compare, _feeds, _model, _options, _reference  # noqa: E402
from test_ort_ops import _session, gpu  # noqa: E402

pytestmark = [gpu, pytest.mark.gpu]
MIN_TOKENS = 64  # kPrefillMinTokens (attention_prefill.h)


def _pair(rng, s, h, hkv, d, past, **options):
    """Two rows (pasts `past` and `past + 29`), a capacity with noise past the longer one, and the model."""
    pasts = [past, past + 29]
    cap = pasts[-1] + s + 16
    feeds = _feeds(rng, 2, s, h, hkv, d, cap, pasts)
    return feeds, cap, _model(True, h, hkv, d, 1.0 / np.sqrt(d), **options)


def _run(session, feeds, monkeypatch, tensor_cores: bool):
    """One call on the tensor-core path (ES_GQA_PREFILL=1, where S allows) or on today's kernel."""
    monkeypatch.setenv("ES_GQA_PREFILL", "1" if tensor_cores else "0")
    return session.run(None, feeds)


# (D, G, S, past): every head size x GQA group (3: SmolLM2's) x lengths on both sides of the threshold.
CORE = [(d, g, s, past) for d in (64, 128, 256) for g in (1, 3, 4, 8) for s in (1, 7, 64, 300) for past in (0, 100)]


@pytest.mark.parametrize("d,g,s,past", CORE)
def test_both_paths_match_the_reference(ops_lib, monkeypatch, d, g, s, past):
    rng = np.random.default_rng(d + 10 * g + 100 * s + past)
    hkv = 2
    feeds, cap, model = _pair(rng, s, g * hkv, hkv, d, past)
    want = _reference(feeds, g * hkv, hkv, d)
    cuda = _session(model, ops_lib, cuda="user")
    _compare(_run(cuda, feeds, monkeypatch, tensor_cores=True), want, [cap] * 2)
    if s >= MIN_TOKENS:
        _compare(_run(cuda, feeds, monkeypatch, tensor_cores=False), want, [cap] * 2)


# (D, S, past, softcap, window): the options on the tensor-core path, windows shorter than the prompt
# (masked tiles, key tiles skipped), a window of one (each token sees itself alone), softcap 2 (bends the
# random scores enough to show), both.
OPTIONS = [(d, s, past, softcap, window) for d in (64, 128, 256) for s in (64, 300) for past in (0, 100)
           for softcap, window in ((2.0, -1), (0.0, 32), (2.0, 32), (0.0, 1))]


@pytest.mark.parametrize("d,s,past,softcap,window", OPTIONS)
def test_options_on_the_tensor_core_path_match_the_reference(ops_lib, monkeypatch, d, s, past, softcap, window):
    rng = np.random.default_rng(d + s + past + int(softcap) + window)
    h, hkv = 8, 2
    feeds, cap, model = _pair(rng, s, h, hkv, d, past, **_options(softcap, window))
    want = _reference(feeds, h, hkv, d, softcap, window)
    plain = _reference(feeds, h, hkv, d)[0].astype(np.float32)
    assert np.abs(plain - want[0].astype(np.float32)).max() > 1e-2  # the option bites
    cuda = _session(model, ops_lib, cuda="ort")
    _compare(_run(cuda, feeds, monkeypatch, tensor_cores=True), want, [cap] * 2)
    _compare(_run(cuda, feeds, monkeypatch, tensor_cores=False), want, [cap] * 2)


# (H, Hkv, D, past, softcap, window): 4096-token prompts. Llama-3.2-1B's heads against today's kernel
# (the reference would need [32, 4096, 4096] scores); fewer heads against the reference.
LONG = [
    (32, 8, 64, 0, 0.0, -1),
    (32, 8, 64, 100, 0.0, -1),
    (32, 8, 128, 100, 50.0, 1024),
    (4, 1, 64, 100, 0.0, -1),
    (8, 2, 128, 0, 0.0, 512),
    (8, 4, 256, 0, 50.0, -1),
]


@pytest.mark.parametrize("h,hkv,d,past,softcap,window", LONG)
def test_long_prompts_match(ops_lib, monkeypatch, h, hkv, d, past, softcap, window):
    s = 4096
    rng = np.random.default_rng(h + d + past)
    cap = past + s + 16
    feeds = _feeds(rng, 1, s, h, hkv, d, cap, [past])
    cuda = _session(_model(True, h, hkv, d, 1.0 / np.sqrt(d), **_options(softcap, window)), ops_lib, cuda="ort")
    got = _run(cuda, feeds, monkeypatch, tensor_cores=True)
    if h > 8:
        _compare(got, _run(cuda, feeds, monkeypatch, tensor_cores=False), [cap])
    else:
        _compare(got, _reference(feeds, h, hkv, d, softcap, window), [cap])


@pytest.mark.parametrize("d,s,past,window", [(64, 300, 1000, 64), (128, 64, 500, 200), (256, 300, 700, 64),
                                             (64, 130, 0, -1), (128, 300, 40, 1)])
def test_keys_outside_a_blocks_range_are_never_read(ops_lib, monkeypatch, d, s, past, window):
    """NaN in every cache position after the row's last token and, with a window, before the first new
    token's window: the output stays finite and equal to the run on the clean cache."""
    h, hkv = 8, 2
    cap = past + s + 64
    feeds = _feeds(np.random.default_rng(s + past), 1, s, h, hkv, d, cap, [past])
    cuda = _session(_model(True, h, hkv, d, 1.0 / np.sqrt(d), **_options(0.0, window)), ops_lib, cuda="ort")
    want = _run(cuda, feeds, monkeypatch, tensor_cores=True)[0]
    for name in ("past_key", "past_value"):
        feeds[name][:, :, past + s:] = np.nan
        if window > 0:
            feeds[name][:, :, : max(0, past + 1 - window)] = np.nan
    got = _run(cuda, feeds, monkeypatch, tensor_cores=True)[0]
    assert np.isfinite(got).all()
    assert np.array_equal(got, want)


def test_rows_out_of_range_give_nan_and_keep_their_cache(ops_lib, monkeypatch):
    h, hkv, d, s, cap = 8, 2, 64, 128, 256
    feeds = _feeds(np.random.default_rng(7), 2, s, h, hkv, d, cap, [10, 10])
    feeds["seqlens_k"] = np.array([10 + s - 1, cap + 5], dtype=np.int32)  # row 1: beyond the capacity
    want = _reference(feeds, h, hkv, d)
    out, pk, pv = _run(_session(_model(True, h, hkv, d, 0.125), ops_lib, cuda="ort"), feeds, monkeypatch, True)
    assert np.isnan(out[1]).all()
    assert np.array_equal(pk[1], feeds["past_key"][1]) and np.array_equal(pv[1], feeds["past_value"][1])
    _compare((out[:1], pk[:1], pv[:1]), tuple(w[:1] for w in want), [cap])


@pytest.mark.parametrize("s,env,tensor_cores", [(MIN_TOKENS, "1", True), (MIN_TOKENS - 1, "1", False),
                                                (300, "0", False), (300, None, True), (1, "1", False)])
def test_prompts_of_64_tokens_or_more_take_the_tensor_core_kernels(ops_lib, monkeypatch, s, env, tensor_cores):
    import torch
    from torch.profiler import ProfilerActivity, profile

    h, hkv, d = 8, 2, 64
    feeds = _feeds(np.random.default_rng(s), 1, s, h, hkv, d, s + 100, [50])
    cuda = _session(_model(True, h, hkv, d, 0.125), ops_lib, cuda="ort")
    cuda.run(None, feeds)  # warm-up outside the profile
    if env is None:
        monkeypatch.delenv("ES_GQA_PREFILL", raising=False)
    else:
        monkeypatch.setenv("ES_GQA_PREFILL", env)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        cuda.run(None, feeds)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if e.device_time_total > 0]
    assert any("prefill_kernel" in n for n in names) == tensor_cores, names
    assert any("attention_kernel" in n for n in names) == (not tensor_cores), names
