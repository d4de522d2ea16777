"""The special tokens of a tokenizer converted from a GGUF file, as the GGUF itself names them.

transformers' GGUF conversion has not given the same special tokens in every version: on the H200
machine (transformers 5.17, session 18) SmolLM2's converted tokenizer had <|im_start|> (id 1) as its EOS,
where the GGUF's `tokenizer.ggml.eos_token_id` is 2 (<|im_end|>) and this machine's transformers (5.24)
agrees with the GGUF. An engine's EOS decides where generation stops and the perplexity protocol's prefix
token, so the ids recorded in the GGUF are applied after the conversion, whatever the version did.
"""

from __future__ import annotations

from pathlib import Path

GGUF_SPECIAL_IDS = {  # the tokenizer's attribute -> the GGUF metadata key of its id
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def gguf_special_ids(gguf: Path) -> dict[str, int]:
    """{attribute: token id} for the special tokens the GGUF's metadata names (absent keys left out)."""
    from gguf import GGUFReader  # deferred: only GGUF sources need it (transformers' GGUF loading does too)

    fields = GGUFReader(str(gguf)).fields
    out = {}
    for attr, key in GGUF_SPECIAL_IDS.items():
        field = fields.get(key)
        if field is not None and field.data:
            out[attr] = int(field.parts[field.data[0]][0])
    return out


def pin_special_tokens(tokenizer, ids: dict[str, int]) -> dict[str, tuple[str | None, str]]:
    """Set the tokenizer's bos/eos/pad/unk to the tokens of `ids` (gguf_special_ids) where they are in its
    vocabulary; returns {attribute: (before, after)} for each one changed."""
    changed = {}
    for attr, token_id in ids.items():
        if not 0 <= token_id < len(tokenizer):
            continue
        text = tokenizer.convert_ids_to_tokens(token_id)
        before = getattr(tokenizer, attr, None)
        if text is not None and before != text:
            setattr(tokenizer, attr, text)
            changed[attr] = (before, text)
    return changed
