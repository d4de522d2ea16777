"""A --for-cuda --kv paged engine of tiny llama (head size 64, fp16) for the tests: the `paged_dir`
fixture (its CPU kernels run here, the CUDA ones on the device), the gpu marker, and a module-scoped
monkeypatch."""

from __future__ import annotations

import pytest

CAPACITY = 256


gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def paged_dir(ort_ops_lib, tmp_path_factory, monkeypatch_module):
    """A --for-cuda --kv paged engine of tiny llama (head size 64, fp16), pages of 16 positions."""
    from enginesmith.builder.engine import BuildConfig, build, cached_engine

    monkeypatch_module.setenv("ENGINESMITH_ORT_OPS_LIB", str(ort_ops_lib))
    src = cached_engine(BuildConfig(model="tiny:llama-hd64", dtype="fp16"), progress=False)
    out = tmp_path_factory.mktemp("paged") / "engine"
    return build(BuildConfig(target="ort-cuda", dtype="fp16", capacity=CAPACITY, kv_layout="paged", page_size=16,
                             max_batch=32), out, source=src, progress=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
