"""What a Triton request asks, checked: its input tensors (untrusted input) turned into generation
settings and prompt token ids, for serving/triton_model.py. Pure: no Triton import, what the unit tests
exercise.

  - numbers are checked as Python ints and floats, as sent (int64 on the wire), against the ranges
    in INT_RANGES and FLOAT_RULES, NaN and infinities refused, before anything could narrow them;
  - special-token spellings in text_input and system are encoded as text (`prompt_ids`), unless
    the deployer set SPECIAL_TOKENS_IN_TEXT=1 (`enginesmith triton --allow-special-tokens-in-text`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.generate import MAX_NEW_TOKENS
from enginesmith.runtime.decoding.sampling import SamplingParams
from enginesmith.runtime.text.chat import encode_prompt
from enginesmith.serving.triton_repository import DEFAULT_MAX_TOKENS, INPUTS


@dataclass(frozen=True)
class RequestSettings:
    prompt: str
    raw: bool
    system: str | None
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]


def _one(values: Mapping[str, Any], name: str) -> Any:
    """The single element of an optional [1] input, or None when the input is absent."""
    array = values.get(name)
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise UserError(f"input {name!r} has {flat.size} elements", f"send exactly one value for {name}")
    return flat[0]


def _text(value: Any, name: str) -> str:
    if isinstance(value, (bytes, np.bytes_)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise UserError(f"input {name!r} is not valid UTF-8", f"send {name} as UTF-8 text") from None
    if isinstance(value, str):
        return value
    raise UserError(f"input {name!r} must be a string", f"send {name} as text")


# Valid ranges of the integer inputs, checked on the Python int: Triton passes int64 (see INPUTS),
# and nothing downstream may see a value that a narrower type would wrap. max_tokens is bounded
# by the runtime's own limit, so the error names the input the client sent.
INT_RANGES = {"max_tokens": (1, MAX_NEW_TOKENS), "top_k": (0, 2**31 - 1), "seed": (0, 2**63 - 1)}
FLOAT_RULES = {"temperature": "a finite number >= 0 (0 = greedy)", "top_p": "a number in (0, 1] (1 = off)",
               "repetition_penalty": "a finite number > 0 (1 = off)"}


def _integer(value: Any, name: str) -> int | None:
    """An integer input as an exact Python int within INT_RANGES[name], or None when absent."""
    if value is None:
        return None
    low, high = INT_RANGES[name]
    rule = f"send {name} as an integer in [{low}, {high}]"
    if isinstance(value, (bool, np.bool_)):
        raise UserError(f"input {name!r} is a boolean, not an integer", rule)
    if isinstance(value, (int, np.integer)):
        number = int(value)  # exact for int64 and uint64 alike: no cast narrows it
    elif isinstance(value, (float, np.floating)):
        real = float(value)
        if not (math.isfinite(real) and real.is_integer()):
            raise UserError(f"input {name!r}={real!r} is not an integer", rule)
        number = int(real)
    else:
        raise UserError(f"input {name!r} is not a number ({type(value).__name__})", rule)
    if not low <= number <= high:
        raise UserError(f"invalid {name}={number}: outside [{low}, {high}]", rule)
    return number


def _real(value: Any, name: str) -> float | None:
    """A float input as a finite Python float (NaN and infinities refused), or None when absent."""
    if value is None:
        return None
    rule = f"{name} must be {FLOAT_RULES[name]}"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise UserError(f"input {name!r} is not a number ({type(value).__name__})", rule)
    try:
        real = float(value)
    except OverflowError:  # a Python int beyond float range
        real = math.inf
    if not math.isfinite(real):
        raise UserError(f"invalid {name}={real}: not a finite number", rule)
    return real


def request_settings(values: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> RequestSettings:
    """Validate one request's tensors ({name: numpy array}); raise UserError naming the bad input
    and its valid range. Numbers are read as Python ints and floats from the arrays as sent."""
    known = {t.name for t in INPUTS}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UserError(f"unknown inputs {', '.join(unknown)}", f"use only: {', '.join(sorted(known))}")
    if values.get("text_input") is None:
        raise UserError("missing input 'text_input'", "send the prompt as text_input")
    prompt = _text(_one(values, "text_input"), "text_input")
    if not prompt:
        raise UserError("empty prompt", "send some text as text_input")
    system = _one(values, "system")
    raw = _one(values, "raw")
    if raw is not None and not isinstance(raw, (bool, np.bool_)):
        raise UserError(f"input 'raw' is not a boolean ({type(raw).__name__})", "send raw as true or false")
    max_tokens = _integer(_one(values, "max_tokens"), "max_tokens")
    params: dict[str, Any] = {}
    for name in ("top_k", "seed"):
        params[name] = _integer(_one(values, name), name)
    for name in FLOAT_RULES:
        params[name] = _real(_one(values, name), name)
    sampling = SamplingParams(**{k: v for k, v in params.items() if v is not None})  # checks the float ranges
    stop_values = values.get("stop")
    stop = tuple(_text(s, "stop") for s in np.asarray(stop_values).reshape(-1)) if stop_values is not None else ()
    if any(not s for s in stop):
        raise UserError("empty stop string", "leave out empty strings from stop")
    return RequestSettings(prompt=prompt, raw=bool(raw) if raw is not None else False,
                           system=_text(system, "system") if system is not None else None,
                           max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                           sampling=sampling, stop=stop)


def prompt_ids(tokenizer: Any, settings: RequestSettings, special_tokens_in_text: bool = False) -> list[int]:
    """Token ids of a request's prompt (chat template unless `raw`). Request text is untrusted: a
    special-token spelling in text_input or system is encoded as text unless the deployer allowed
    it (ModelOptions.special_tokens_in_text), so a client cannot forge a system or assistant turn."""
    return encode_prompt(tokenizer, settings.prompt, raw=settings.raw, system=settings.system,
                         special_tokens_in_text=special_tokens_in_text)
