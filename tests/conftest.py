"""Shared fixtures. The real SmolLM2 is exported at most once: engines are built through the same
content-hash-keyed cache that `enginesmith run` uses (ENGINESMITH_CACHE, default ~/.cache), so a
second test session, or a `run` before it, reuses them.

- `smollm2`: the embedded default model (`LoadedModel`: fp32 torch model + tokenizer).
- `smollm2_engine`: Path of the default fp32 ONNX Runtime engine directory.
- `smollm2_onnx`: Path of its model.onnx (KV-cache I/O, external data).
- `tiny_engine(family)`: engine directory of a tiny random model (`tiny:<family>`).
- `austen`: the Jane Austen corpus (Debian package r-cran-janeaustenr) is installed; tests that read
  it (`eval ppl`'s default text, calibration) ask for it, so they skip without it (fail under
  ENGINESMITH_TEST_STRICT=1, see tests/external.py).
Tests that use the SmolLM2 fixtures are `@pytest.mark.slow` (they still run in CI).
"""

from __future__ import annotations

import pytest

from external import missing

FAMILIES = ["llama", "qwen2", "mistral", "gpt2"]


def _require_default_model():
    from enginesmith.core.errors import UserError
    from enginesmith.models.load import default_gguf

    try:
        default_gguf()
    except UserError as exc:
        missing(f"default model: {exc.what}", exc.fix)


@pytest.fixture(scope="session")
def austen():
    from enginesmith.core.errors import UserError
    from enginesmith.models import corpus

    try:
        corpus.data_dir()
    except UserError as exc:
        missing(exc.what, exc.fix)


@pytest.fixture(scope="session")
def smollm2():
    from enginesmith.models.load import load

    _require_default_model()
    return load(None)


@pytest.fixture(scope="session")
def smollm2_engine():
    from enginesmith.build.engine import BuildConfig, cached_engine

    _require_default_model()
    return cached_engine(BuildConfig(), progress=False)


@pytest.fixture(scope="session")
def smollm2_onnx(smollm2_engine):
    return smollm2_engine / "model.onnx"


@pytest.fixture(scope="session")
def tiny_engine():
    from enginesmith.build.engine import BuildConfig, cached_engine

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = cached_engine(BuildConfig(model=f"tiny:{family}"), progress=False)
        return built[family]

    return get
