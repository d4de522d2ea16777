"""Fixtures for the pass tests: tiny models exported once per session, with weights that make
quantization and smoothing visible, and a small calibration set.

Tiny random models leave norms at 1 and biases at 0 (the exporter then shares one norm weight
between all layers and drops the zero biases); here they get random norms and biases and a few
outlier input channels, as real LLM activations have.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


def _perturb(model, seed: int = 0) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() != 1:
                continue
            if "bias" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:  # norm weights: around 1, with a few outlier channels (activation outliers)
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
                p[torch.randint(0, p.numel(), (3,), generator=gen)] *= 12.0


@pytest.fixture(scope="session", autouse=True)
def _private_cache(tmp_path_factory):
    """Calibration statistics of the tests go to a session temp dir, not ~/.cache."""
    global _CACHE_ROOT
    from enginesmith.core.paths import cache_dir

    _CACHE_ROOT = cache_dir()
    mp = pytest.MonkeyPatch()
    mp.setenv("ENGINESMITH_CACHE", str(tmp_path_factory.mktemp("cache")))
    yield
    mp.undo()


PERTURB_VERSION = 1
_CACHE_ROOT = None  # the user's cache dir, read before _private_cache redirects it


def _export_key(family: str) -> str:
    import hashlib

    import onnxscript
    import torch
    import transformers

    from enginesmith.models.load import resolve

    text = f"{resolve('tiny:' + family).sha256}|{PERTURB_VERSION}|{torch.__version__}|" \
           f"{transformers.__version__}|{onnxscript.__version__}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@pytest.fixture(scope="session")
def tiny_onnx():
    """tiny_onnx(family) -> Path of the perturbed tiny model's fp32 model.onnx (opset 23), exported
    once into the user's cache (keyed by config, perturbation and library versions)."""
    import os
    import shutil
    import tempfile

    from enginesmith.export.to_onnx import export
    from enginesmith.models.load import load

    def get(family: str) -> Path:
        target = _CACHE_ROOT / "test-tiny" / f"{family}-{_export_key(family)}"
        if not (target / "model.onnx").is_file():
            model = load(f"tiny:{family}").model
            _perturb(model)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
            try:
                export(model, tmp / "model.onnx", opset=23)
                os.replace(tmp, target)
            except OSError:  # another session exported it meanwhile
                shutil.rmtree(tmp, ignore_errors=True)
        return target / "model.onnx"

    return get


@pytest.fixture(scope="session")
def calib():
    """4 windows of 32 random token ids: enough for tiny models' statistics."""
    from enginesmith.passes import from_tokens

    tokens = np.random.default_rng(0).integers(0, 49152, size=4 * 32 + 7)
    return from_tokens(tokens, "random:test", samples=4, seq_len=32)


@pytest.fixture(scope="session")
def smollm2_graph(request) -> Path:
    """SmolLM2's fp32 graph: $ENGINESMITH_TEST_SMOLLM2_ONNX, else the shared `smollm2_onnx`."""
    import os

    given = os.environ.get("ENGINESMITH_TEST_SMOLLM2_ONNX")
    if given:
        return Path(given)
    return request.getfixturevalue("smollm2_onnx")
