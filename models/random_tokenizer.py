"""The tokenizer of random-weights models (`tiny:<family>`, `random:<shape>`), built in code.

Random models must not need the embedded default model's package for their tokenizer, and their
vocabulary (49152 for tiny models, 128256 for `random:llama-3.2-1b`) must be covered id for id.
So this is a byte-level tokenizer (any text encodes, one token per byte; no merges, hence no
download and no training) whose vocabulary is filled up to `vocab_size` with lowercase words,
each with its leading space, so that any id a random model samples decodes to a readable word. Special tokens and ids
follow SmolLM2's ChatML layout (0 <|endoftext|>, 1 <|im_start|>, 2 <|im_end|>), which is what the
tiny configs' bos/eos/pad ids say, and a ChatML chat template makes `run` without `--raw` work.
The same `vocab_size` always gives the same tokenizer.
"""

from __future__ import annotations

import itertools
import string

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

VERSION = "bytes-v2"  # part of a random model's source hash: change it when the tokenizer changes
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _pieces():
    """Words for the ids past the bytes: ' a' ... ' z', ' aa' ... ' zz', ' aaa' ..., each with its
    leading space, so a random model's output reads as words however its ids repeat."""
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            yield "Ġ" + "".join(letters)  # byte-level spelling of " " + word


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet in byte order: byte b is spelled as character [b]."""
    chars, shifted = [], 0
    for b in range(256):
        if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255:  # printable: spelled as itself
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


def vocabulary(vocab_size: int) -> dict[str, int]:
    """Token -> id for ids 0..vocab_size-1: the special tokens, the 256 bytes, then word pieces."""
    first = list(SPECIAL) + byte_alphabet()
    if vocab_size < len(first):
        raise ValueError(f"a byte-level vocabulary needs at least {len(first)} ids (got {vocab_size})")
    vocab = {token: i for i, token in enumerate(first)}
    pieces = _pieces()
    while len(vocab) < vocab_size:
        piece = next(pieces)
        if piece not in vocab:
            vocab[piece] = len(vocab)
    return vocab


def build(vocab_size: int):
    """A transformers fast tokenizer with exactly `vocab_size` ids (see the module docstring)."""
    # deferred: transformers takes seconds to import, and models.load.resolve needs only VERSION
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab=vocabulary(vocab_size), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>",
        unk_token="<|endoftext|>", chat_template=CHAT_TEMPLATE, model_max_length=1 << 30)
