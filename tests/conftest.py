"""Shared fixtures. The real SmolLM2 is exported at most once: engines are built through the same
content-hash-keyed cache that `enginesmith run` uses, so a second test session reuses them.

- `smollm2`: the embedded default model (`LoadedModel`: fp32 torch model + tokenizer).
- `smollm2_engine`: Path of the default fp32 ONNX Runtime engine directory.
- `smollm2_onnx`: Path of its model.onnx (KV-cache I/O, external data).
- `tiny_engine(family)`: engine directory of a tiny random model (`tiny:<family>`).
- `austen`: the Jane Austen corpus (Debian package r-cran-janeaustenr) is installed; tests that read
  it (`eval ppl`'s default text, calibration) ask for it, so they skip without it (fail under
  ENGINESMITH_TEST_STRICT=1, see tests/helpers/external.py).
Tests that use the SmolLM2 fixtures are `@pytest.mark.slow` (they still run in CI).

Tests never write into the user's cache: unless ENGINESMITH_CACHE names one, they use a per-user
folder under the temp dir (shared by pytest-xdist workers and later sessions; cached engines carry the
builder's code fingerprint, so one written by other code is rebuilt).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.external import missing


def pytest_configure(config):
    from helpers.plugin_build import shared_root

    if not os.environ.get("ENGINESMITH_CACHE"):
        os.environ["ENGINESMITH_CACHE"] = str(shared_root() / "cache")


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
    from enginesmith.builder.engine import BuildConfig, cached_engine

    _require_default_model()
    return cached_engine(BuildConfig(), progress=False)


@pytest.fixture(scope="session")
def smollm2_onnx(smollm2_engine):
    return smollm2_engine / "model.onnx"


@pytest.fixture(scope="session")
def tiny_engine():
    from enginesmith.builder.engine import BuildConfig, cached_engine

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = cached_engine(BuildConfig(model=f"tiny:{family}"), progress=False)
        return built[family]

    return get


@pytest.fixture(scope="session")
def ort_ops_lib(request):
    """libenginesmith_ort_ops.so for the tests that run enginesmith's ORT ops (their CPU kernels here):
    $ENGINESMITH_ORT_OPS_LIB or $ENGINESMITH_PLUGINS_BUILD's if built (the GPU machine), else compiled
    once here for one arch, the ops target alone (tests/helpers/plugin_build.py; nvcc and cmake needed: else a
    skip, a failure under strict)."""
    from enginesmith.plugins import compile as plugin_compile
    from helpers.plugin_build import compile_targets

    for env, name in (("ENGINESMITH_ORT_OPS_LIB", ""), (plugin_compile.BUILD_ENV, plugin_compile.LIBRARIES["ort_ops"])):
        given = Path(os.environ.get(env, "/nonexistent")) / name
        if os.environ.get(env) and given.is_file():
            return given
    if plugin_compile.find_nvcc() is None or plugin_compile.find_cmake() is None:
        missing("nvcc and cmake are needed to compile the ORT ops library", "install the CUDA toolkit and cmake")
    out = compile_targets(request.config, ("enginesmith_ort_ops",), what="the ONNX Runtime ops library")
    return out / plugin_compile.LIBRARIES["ort_ops"]


@pytest.fixture(scope="session")
def paged_engine():
    """A tiny random Llama engine with paged KV for the CPU (build --kv paged), cached."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    return cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged"), progress=False)
