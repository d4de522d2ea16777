"""The PagedAttention plugin's limits the TensorRT lowering refuses by: one Python copy
(paged_lower.PLUGIN_LIMITS) of what plugins/paged_attention/paged_attention.h defines, held to the
header here on every machine and to the kernels library's C API wherever the library is built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from enginesmith.passes.lower import paged_lower
from enginesmith.plugins import kernels

HEADER = Path(__file__).resolve().parents[2] / "plugins" / "paged_attention" / "paged_attention.h"


def _header_limits() -> dict:
    text = HEADER.read_text()

    def ints(name):
        return tuple(int(x) for x in re.search(name + r"\[\]\s*=\s*\{([^}]*)\}", text).group(1).split(","))

    return {"head_sizes": ints("kSupportedHeadSizes"), "block_sizes": ints("kSupportedBlockSizes"),
            "max_query_len": int(re.search(r"kMaxQueryLen\s*=\s*(\d+)", text).group(1))}


def test_the_python_copy_matches_the_header():
    assert paged_lower.PLUGIN_LIMITS == _header_limits()


def _built() -> bool:
    path = kernels.library_path()
    return path is not None and path.is_file()


@pytest.mark.skipif(not _built(), reason="libenginesmith_kernels.so is not built on this machine "
                    "(tests/plugins builds it; the header check above still runs)")
def test_the_python_copy_matches_the_c_api():
    lim = kernels.paged_attention_limits()
    assert paged_lower.PLUGIN_LIMITS == {"head_sizes": lim.head_sizes, "block_sizes": lim.block_sizes,
                                         "max_query_len": lim.max_query_len}
    assert paged_lower.plugin_limits() == paged_lower.PLUGIN_LIMITS


def test_without_the_library_the_lowering_uses_the_python_copy(monkeypatch):
    monkeypatch.setattr(kernels, "library_path", lambda: None)
    assert paged_lower.plugin_limits() == paged_lower.PLUGIN_LIMITS
