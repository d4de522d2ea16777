"""The engine's tokenizer, read from its files without importing transformers or torch.

An engine directory's tokenizer/ holds what `save_pretrained` wrote: tokenizer.json (the fast
tokenizer, with its pre/post-processors), tokenizer_config.json (special tokens) and the chat
template. Loading transformers costs seconds of start-up for every `run`; the `tokenizers` package
and jinja2 are all a runtime needs. The subset of the transformers tokenizer API offered here is
what the runtime, evaluation and deployment code call; tests check it against transformers.

These files are untrusted input (engines travel): each is read only if it is a regular file (no
symlink, no FIFO) of bounded size, parsed strictly (UTF-8, JSON of the expected shape), and the
chat template is compiled at load and rendered under runtime.text.chat_template's limits. Any problem
is an EngineError naming the file.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

from jinja2 import TemplateSyntaxError
from jinja2.sandbox import SecurityError
from tokenizers import Tokenizer as FastTokenizer

from enginesmith.core.engine_dir import rebuild_fix
from enginesmith.core.errors import EngineError, UserError
from enginesmith.runtime.text import chat_template

MAX_TOKENIZER_JSON_BYTES = 64 << 20
MAX_OTHER_FILE_BYTES = 4 << 20


class Tokenizer:
    FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._fix = rebuild_fix(self.directory.parent)
        path = self.directory / "tokenizer.json"
        text = self._read_text("tokenizer.json", MAX_TOKENIZER_JSON_BYTES)
        if text is None:
            raise EngineError(f"{path} is missing", "rebuild the engine (its tokenizer must be a fast tokenizer): "
                              + self._fix)
        try:
            self._tok = FastTokenizer.from_str(text)
        except Exception as exc:  # the Rust parser raises a bare Exception for every problem
            raise EngineError(f"{path} is not a tokenizer the tokenizers library can read "
                              f"({_first_line(exc)})", self._fix) from None
        self._plain: FastTokenizer | None = None  # made on first need: see encode(split_special_tokens=)
        config = self._read_config()
        self._special = {name: self._token_text(config, name) for name in ("bos", "eos", "pad", "unk")}
        specials = sorted((t.content for t in self._tok.get_added_tokens_decoder().values() if t.special and t.content),
                          key=len, reverse=True)
        self.special_tokens_text: tuple[str, ...] = tuple(specials)
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials else None
        self.chat_template, self._template_file = self._read_template(config)
        self._template = self._compile(self.chat_template) if self.chat_template else None

    # ------------------------------------------------------------------------- reading the files

    def _read_text(self, name: str, limit: int) -> str | None:
        """The UTF-8 text of a regular file of at most `limit` bytes in the directory; None if absent."""
        path = self.directory / name
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise EngineError(f"{path} cannot be read ({exc.strerror})", self._fix) from None
        if stat.S_ISLNK(st.st_mode):
            raise EngineError(f"{path} is a symbolic link; tokenizer files must be regular files", self._fix)
        if not stat.S_ISREG(st.st_mode):
            raise EngineError(f"{path} is not a regular file (a directory, FIFO, socket or device)", self._fix)
        if st.st_size > limit:
            raise EngineError(f"{path} is {st.st_size} bytes, more than the {limit} bytes allowed for {name}",
                              self._fix)
        try:  # O_NOFOLLOW/O_NONBLOCK: a file swapped for a link or FIFO since lstat neither escapes nor hangs
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise EngineError(f"{path} is not a regular file", self._fix)
                data = f.read(limit + 1)
        except OSError as exc:
            raise EngineError(f"{path} cannot be read ({exc.strerror})", self._fix) from None
        if len(data) > limit:
            raise EngineError(f"{path} grew past the {limit} bytes allowed for {name} while being read", self._fix)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise EngineError(f"{path} is not UTF-8 text (byte {exc.start})", self._fix) from None

    def _read_config(self) -> dict:
        text = self._read_text("tokenizer_config.json", MAX_OTHER_FILE_BYTES)
        if text is None:
            return {}
        path = self.directory / "tokenizer_config.json"
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise EngineError(f"{path} is not valid JSON ({exc.msg}, line {exc.lineno})", self._fix) from None
        except (ValueError, RecursionError) as exc:  # e.g. an integer of too many digits, nesting too deep
            raise EngineError(f"{path} is not JSON this loader accepts ({_first_line(exc)})", self._fix) from None
        if not isinstance(config, dict):
            raise EngineError(f"{path} holds a JSON {type(config).__name__}, not an object", self._fix)
        return config

    def _token_text(self, config: dict, name: str) -> str | None:
        """tokenizer_config stores a special token as a string or as an AddedToken dict."""
        value = config.get(f"{name}_token")
        if isinstance(value, dict):
            value = value.get("content")
        if value is not None and not isinstance(value, str):
            raise EngineError(f"{self.directory / 'tokenizer_config.json'}: {name}_token is a "
                              f"{type(value).__name__}, not a string or an AddedToken object", self._fix)
        return value

    def _read_template(self, config: dict) -> tuple[str | None, str]:
        """The chat template's source and the file (and field) it came from: chat_template.jinja,
        else tokenizer_config's chat_template (checked either way)."""
        where = f"{self.directory / 'tokenizer_config.json'} (chat_template)"
        value = config.get("chat_template")
        if isinstance(value, list):  # transformers' named templates: [{"name": ..., "template": ...}]
            if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
                       for t in value):
                raise EngineError(f"{where} is a list whose items are not {{name, template}} strings", self._fix)
            value = next((t["template"] for t in value if t["name"] == "default"), None)
        if value is not None and not isinstance(value, str):
            raise EngineError(f"{where} is a {type(value).__name__}, not a string", self._fix)
        text = self._read_text("chat_template.jinja", MAX_OTHER_FILE_BYTES)
        if text is not None:
            return text, str(self.directory / "chat_template.jinja")
        return value, where

    def _compile(self, source: str):
        try:
            return chat_template.compile_template(source)
        except TemplateSyntaxError as exc:
            raise EngineError(f"the chat template in {self._template_file} has a Jinja syntax error at line "
                              f"{exc.lineno}: {_first_line(exc.message or exc)}", self._fix) from None
        except Exception as exc:  # e.g. nesting too deep for jinja's or Python's compiler
            raise EngineError(f"the chat template in {self._template_file} cannot be compiled "
                              f"({type(exc).__name__}: {_first_line(exc)})", self._fix) from None

    # ------------------------------------------------------------------------- special tokens (transformers' names)

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

    # ------------------------------------------------------------------------- text <-> ids

    def __call__(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False,
                 **_ignored) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens,
                                         split_special_tokens=split_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True, split_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. With `split_special_tokens` (transformers' name), text that spells a
        special token (e.g. "<|im_start|>") is encoded as the plain text it is, never as that token;
        `add_special_tokens` (the post-processor's BOS/EOS) is independent of it."""
        if not isinstance(text, str):
            raise TypeError(f"text to encode must be a str, not {type(text).__name__}")
        tok = self._tok
        if split_special_tokens and self._special_re is not None and self._special_re.search(text):
            tok = self._plain_tokenizer()
        try:
            return tok.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:
            check_text(text, "the text")  # lone surrogates (bytes of argv that are not UTF-8)
            raise

    def _plain_tokenizer(self) -> FastTokenizer:
        """A copy that does not recognise special tokens in text. A copy, not a toggle of the shared
        tokenizer's flag, so that concurrent encodes (servers) never see each other's setting."""
        if self._plain is None:
            plain = FastTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        tid = self._tok.token_to_id(token)
        return self.unk_token_id if tid is None else tid

    # ------------------------------------------------------------------------- chat template

    def apply_chat_template(self, messages: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, **extra):
        """Render the template as transformers does (sandboxed jinja2, trim/lstrip blocks), under
        runtime.text.chat_template's time and size limits. A template over a limit, or failing, is an
        EngineError; one that refuses the messages with raise_exception(...) is a UserError."""
        if self._template is None:
            raise UserError("this model's tokenizer has no chat template", "use --raw to continue plain text")
        try:
            text = chat_template.render(self._template, input_chars=_text_chars(messages), messages=messages,
                                        add_generation_prompt=add_generation_prompt,
                                        bos_token=self._special["bos"] or "", eos_token=self._special["eos"] or "",
                                        **extra)
        except UserError:
            raise
        except chat_template.TemplateRaised as exc:
            raise UserError(f"the chat template refuses these messages: {_first_line(exc)}",
                            "change the conversation as it asks (e.g. leave out --system), or use --raw") from None
        except chat_template.TemplateLimitError as exc:
            raise EngineError(f"the chat template in {self._template_file} went over a limit: {exc}",
                              self._fix) from None
        except SecurityError as exc:
            raise EngineError(f"the chat template in {self._template_file} did something the sandbox forbids: "
                              f"{_first_line(exc)}", self._fix) from None
        except Exception as exc:  # the template's own bug (UndefinedError, TypeError, RecursionError, ...)
            raise EngineError(f"the chat template in {self._template_file} failed: {type(exc).__name__}: "
                              f"{_first_line(exc)}", self._fix) from None
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in self.FILES:
            source = self.directory / name
            try:
                regular = stat.S_ISREG(os.lstat(source).st_mode)  # never copy a link's target or a FIFO
            except OSError:
                regular = False
            if regular:
                shutil.copy2(source, directory / name, follow_symlinks=False)


def check_text(text: str, what: str) -> None:
    """UserError if `text` holds lone surrogates: how Python hands over argv/stdin bytes that are not UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise UserError(f"{what} is not valid UTF-8", "pass text encoded as UTF-8") from None


def _text_chars(value, depth: int = 0) -> int:
    """Characters of the strings in messages (what a template's size budget scales with)."""
    if isinstance(value, str):
        return len(value)
    if depth > 4:
        return 0
    if isinstance(value, dict):
        return sum(_text_chars(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v, depth + 1) for v in value)
    return 0


def _first_line(exc) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:300]
