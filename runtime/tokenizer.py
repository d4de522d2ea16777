"""The engine's tokenizer, read from its files without importing transformers or torch.

An engine directory's tokenizer/ holds what `save_pretrained` wrote: tokenizer.json (the fast
tokenizer, with its pre/post-processors), tokenizer_config.json (special tokens) and the chat
template. Loading transformers costs seconds of start-up for every `run`; the `tokenizers` package
and jinja2 are all a runtime needs. The subset of the transformers tokenizer API offered here is
what the runtime, evaluation and deployment code call; tests check it against transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from enginesmith.errors import EngineError


class Tokenizer:
    FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

    def __init__(self, directory: str | Path) -> None:
        from tokenizers import Tokenizer as FastTokenizer

        self.directory = Path(directory)
        path = self.directory / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{path} is missing", "rebuild the engine (its tokenizer must be a fast tokenizer)")
        self._tok = FastTokenizer.from_file(str(path))
        config_path = self.directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        template = self.directory / "chat_template.jinja"
        self.chat_template: str | None = template.read_text() if template.is_file() else config.get("chat_template")
        self._special = {name: _token_text(config.get(f"{name}_token")) for name in ("bos", "eos", "pad", "unk")}

    # special tokens, as transformers names them
    def _id(self, name: str) -> int | None:
        text = self._special[name]
        return None if text is None else self._tok.token_to_id(text)

    bos_token_id = property(lambda self: self._id("bos"))
    eos_token_id = property(lambda self: self._id("eos"))
    pad_token_id = property(lambda self: self._id("pad"))
    unk_token_id = property(lambda self: self._id("unk"))
    bos_token = property(lambda self: self._special["bos"])
    eos_token = property(lambda self: self._special["eos"])

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __call__(self, text: str, add_special_tokens: bool = True, **_ignored) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, **extra):
        """Render the template as transformers does (sandboxed jinja2, trim/lstrip blocks)."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _compiled(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self._special["bos"] or "", eos_token=self._special["eos"] or "", **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in self.FILES:
            if (self.directory / name).is_file():
                shutil.copy2(self.directory / name, directory / name)


def _token_text(value) -> str | None:
    """tokenizer_config stores a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


_TEMPLATES: dict[str, object] = {}


def _compiled(source: str):
    if source not in _TEMPLATES:
        from jinja2 import TemplateError  # noqa: F401  (jinja2 is a declared dependency)
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"chat template error: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(x, indent=indent,
                                                                                     ensure_ascii=ensure_ascii)
        env.globals["raise_exception"] = raise_exception
        _TEMPLATES[source] = env.from_string(source)
    return _TEMPLATES[source]
