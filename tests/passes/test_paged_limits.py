"""The kernels' limits are defined once, in plugins/limits.json: the lowering passes read it through
plugins/limits.py (no Python copy, no header parsing), the build compiles it in, and wherever the
kernels library is built its C API must report the same values."""

from __future__ import annotations

import pytest

from enginesmith.passes.lower import paged_lower
from enginesmith.passes.quant import sparsify
from enginesmith.plugins import kernels
from enginesmith.plugins.limits import limits


def test_the_lowerings_read_limits_json():
    pa = limits()["paged_attention"]
    assert paged_lower.plugin_limits() == {"head_sizes": pa["head_sizes"], "block_sizes": pa["block_sizes"],
                                           "max_query_len": pa["max_query_len"]}
    assert sparsify.plugin_dim_align() == limits()["sparse_gemm"]["dim_align"]
    assert not hasattr(paged_lower, "PLUGIN_LIMITS")  # no Python copy to drift


def test_the_lowering_needs_no_kernels_library(monkeypatch):
    monkeypatch.setattr(kernels, "library_path", lambda: None)
    monkeypatch.setattr(kernels, "lib", lambda: pytest.fail("the lowering loaded the kernels library"))
    assert paged_lower.plugin_limits()["max_query_len"] == limits()["paged_attention"]["max_query_len"]


def _built() -> bool:
    path = kernels.library_path()
    return path is not None and path.is_file()


@pytest.mark.skipif(not _built(), reason="libenginesmith_kernels.so is not built on this machine, so there is "
                    "no C API to hold to plugins/limits.json (tests/plugins/test_plugin_build.py builds it)")
def test_the_c_api_matches_limits_json():
    lim = kernels.paged_attention_limits()
    assert {"head_sizes": lim.head_sizes, "block_sizes": lim.block_sizes,
            "max_query_len": lim.max_query_len} == limits()["paged_attention"]
