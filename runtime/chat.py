"""Prompts to token ids: chat templates for instruct models, or raw text continuation."""

from __future__ import annotations

from enginesmith.errors import UserError


def encode_chat(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of `messages` under the tokenizer's chat template, ready for the reply."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("this model's tokenizer has no chat template", "use --raw to continue plain text")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_prompt(tokenizer, prompt: str, raw: bool = False, system: str | None = None) -> list[int]:
    """A single user prompt: chat-formatted unless `raw` (then plain text, with BOS if the model uses one)."""
    if not isinstance(prompt, str) or not prompt:
        raise UserError("empty prompt", "give some text to start from")
    if raw:
        return tokenizer(prompt)["input_ids"]
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_chat(tokenizer, messages)


def stop_token_ids(tokenizer, manifest) -> tuple[int, ...]:
    """End-of-sequence ids of the model and of the chat template's turn end."""
    ids = set(manifest.model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return tuple(sorted(ids))
