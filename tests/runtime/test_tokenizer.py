"""The runtime's transformers-free tokenizer against transformers' own, on the default tokenizer."""

from __future__ import annotations

import pytest

from enginesmith.runtime.text.tokenizer import Tokenizer
from helpers.external import missing

TEXTS = ["Hello world", "  Café — 東京 🙂\n\nnew paragraph", "<|im_start|>user\nhi<|im_end|>", ""]


@pytest.fixture(scope="module", params=["smollm2", "random"])
def pair(request, tiny_engine, tmp_path_factory):
    """(transformers, ours) over the same files: SmolLM2's tokenizer (skipped when the default model's
    package is not installed) and the built-in one that random models carry."""
    from transformers import AutoTokenizer

    if request.param == "smollm2":
        from enginesmith.core.errors import UserError
        from enginesmith.models.load import default_gguf, load_tokenizer, resolve

        try:
            default_gguf()
        except UserError as exc:
            missing(f"default model: {exc.what}", exc.fix)
        directory = tmp_path_factory.mktemp("smollm2-tokenizer")
        load_tokenizer(resolve(None)).save_pretrained(directory)
    else:
        directory = tiny_engine("llama") / "tokenizer"
    return AutoTokenizer.from_pretrained(directory), Tokenizer(directory)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(pair, text):
    hf, ours = pair
    for special in (True, False):
        assert ours(text, add_special_tokens=special)["input_ids"] == hf(text, add_special_tokens=special)["input_ids"]
    ids = hf(text)["input_ids"]
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_chat_template_and_special_tokens_match_transformers(pair):
    hf, ours = pair
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Capital of France?"}]
    for gen in (True, False):
        assert ours.apply_chat_template(messages, add_generation_prompt=gen) == \
            hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    for name in ("eos_token_id", "bos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(hf, name), name
    assert len(ours) == len(hf)
    assert ours.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")


def test_runtime_does_not_import_transformers(tiny_engine):
    import subprocess
    import sys

    code = ("import sys; from enginesmith.runtime.load import open_engine; "
            f"e = open_engine({str(tiny_engine('llama'))!r}, device='cpu'); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["False", "False"], out.stderr
