"""Paged KV graphs for the tests: kv_paged applied to a tiny engine's dense graph (the `paged` fixture,
built once per module) and a 2-layer Llama of head size 64 exported in fp16 (h64_fp16_graph)."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from enginesmith.passes import Step, run_pipeline
from enginesmith.passes.kv.kv_paged import KVPagedParams

VOCAB = 49152


def make_paged(dense: Path, dst: Path, page_size: int, lower: str = "cpu") -> dict:
    """kv_paged through the pass manager (which compares a cpu lowering with `dense`): its report."""
    (report,) = run_pipeline(dense, dst, [Step("kv_paged", KVPagedParams(page_size, lower))], progress=False)
    return report


@pytest.fixture(scope="module")
def paged(tiny_engine, tmp_path_factory):
    """paged(family, page_size) -> (dense model.onnx, paged model.onnx (cpu lowering), report)."""
    made: dict = {}

    def get(family: str, page_size: int):
        if (family, page_size) not in made:
            dense = tiny_engine(family) / "model.onnx"
            out = tmp_path_factory.mktemp(f"paged-{family}-{page_size}") / "model.onnx"
            made[family, page_size] = dense, out, make_paged(dense, out, page_size)
        return made[family, page_size]

    return get


def h64_fp16_graph() -> Path:
    """A 2-layer Llama with head size 64 (what the TensorRT plugin supports), exported in fp16 once
    into the cache dir (keyed by the library versions)."""
    import onnxscript
    import torch
    import transformers

    from enginesmith.export.to_onnx import export
    from enginesmith.core.paths import cache_dir

    key = hashlib.sha256(f"h64|{torch.__version__}|{transformers.__version__}|{onnxscript.__version__}"
                         .encode()).hexdigest()[:16]
    target = cache_dir() / "test-tiny" / f"paged-h64-fp16-{key}"
    if not (target / "model.onnx").is_file():
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2, pad_token_id=2)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.08)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
        try:
            export(model, tmp / "model.onnx", dtype="fp16")
            os.replace(tmp, target)
        except OSError:  # another session exported it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return target / "model.onnx"
