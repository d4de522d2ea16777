"""The OpenAI API's request and response bodies, as `enginesmith serve` speaks them (pure: no HTTP).

    POST /v1/completions        body ──parse_completion──▶ GenerationRequest (prompt: text or token ids)
    POST /v1/chat/completions   body ──parse_chat────────▶ GenerationRequest (messages)
    responses: completion_body / chat_body (whole), completion_chunk / chat_chunk / usage_chunk (SSE),
    error_body ({"error": {"message", "type", "param", "code"}}) for every refusal (ApiError)

A body is untrusted input, checked field by field as sent (JSON types, not coerced: "0.5" is not a
number, true is not an integer, 16.0 is not an integer), every value against its range, every size
bounded. A field this server does not know is refused (as OpenAI does); one it knows but does not
implement (n > 1, echo, logprobs, penalties other than repetition_penalty, tools) is refused with a
message that says so, never silently ignored. null means "not given" for every optional field.

Extensions beyond OpenAI's fields: top_k (0 or -1 = off), repetition_penalty (1 = off), ignore_eos
(generate max_tokens tokens whatever the model says; for benchmarks).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from enginesmith.runtime.decoding.generate import MAX_NEW_TOKENS
from enginesmith.runtime.decoding.sampling import SamplingParams

MAX_STOP_STRINGS = 8          # OpenAI allows 4
MAX_STOP_CHARS = 256          # per stop string (the scheduler decodes that much of each output per step)
MAX_MESSAGES = 2048
MAX_SEED = 2 ** 63 - 1
MAX_TEMPERATURE = 2.0         # OpenAI's range: [0, 2]
MAX_REPETITION_PENALTY = 100.0

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                 "stream_options", "n", "logprobs", "user", "frequency_penalty", "presence_penalty", "logit_bias",
                 "repetition_penalty", "ignore_eos"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "best_of", "echo", "suffix"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                               "parallel_tool_calls", "functions", "function_call", "response_format", "metadata",
                               "store", "service_tier"}
ROLES = {"system", "developer", "user", "assistant"}  # developer: OpenAI's newer name for system


class ApiError(Exception):
    """A request refused with an OpenAI-style error: HTTP `status`, a message, and the field at fault."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.retry_after = status, message, param, code, retry_after

    def body(self) -> dict:
        return error_body(self.message, self.TYPES.get(self.status, "invalid_request_error"), self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request of either endpoint."""

    model: str
    prompt: str | list[int] | None      # /v1/completions: text (continued as is) or token ids
    messages: list[dict] | None         # /v1/chat/completions: [{"role", "content": str}]
    max_tokens: int | None              # None: the endpoint's default
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool                 # stream_options.include_usage: a last chunk with `usage`
    ignore_eos: bool


# ----------------------------------------------------------------------------- reading a body

def parse_json(raw: bytes) -> dict:
    """The body as a JSON object; NaN/Infinity and absurd nesting refused (ApiError 400)."""
    def no_constants(name):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise ApiError(400, f"the body is not valid JSON: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the body must be a JSON object, not {_json_type(body)}")
    return body


def parse_completion(body: dict, vocab: int) -> GenerationRequest:
    """A /v1/completions body (ApiError 400 naming the field at fault)."""
    _known(body, COMPLETION_FIELDS)
    _only_default(body, "best_of", 1, "this server returns one choice per request (best_of must be 1)")
    _only_default(body, "echo", False, "echo is not supported (the prompt is not repeated in the answer)")
    _only_default(body, "suffix", None, "suffix (insertion) is not supported")
    if body.get("logprobs") is not None:
        raise ApiError(400, "logprobs are not supported by this server", "logprobs", "unsupported")
    return _request(body, _prompt(body.get("prompt"), vocab), None)


def parse_chat(body: dict) -> GenerationRequest:
    """A /v1/chat/completions body (ApiError 400 naming the field at fault)."""
    _known(body, CHAT_FIELDS)
    if body.get("logprobs") not in (None, False):
        raise ApiError(400, "logprobs are not supported by this server", "logprobs", "unsupported")
    _only_default(body, "top_logprobs", None, "top_logprobs are not supported by this server")
    for name in ("tools", "functions"):
        if body.get(name) not in (None, []):
            raise ApiError(400, f"{name} (tool calling) is not supported by this server", name, "unsupported")
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise ApiError(400, f"{name} is not supported by this server (no tools)", name, "unsupported")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported", "response_format", "unsupported")
    _typed(body, "parallel_tool_calls", bool)
    _typed(body, "store", bool)
    _typed(body, "metadata", dict)
    _typed(body, "service_tier", str)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        if body.get("max_tokens") is not None and body["max_tokens"] != body["max_completion_tokens"]:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; give one of them", "max_tokens")
        body = {**body, "max_tokens": body["max_completion_tokens"]}
        _integer(body, "max_completion_tokens", 1, MAX_NEW_TOKENS)
    return _request(body, None, _messages(body.get("messages")))


def _request(body: dict, prompt, messages) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required (a string: see GET /v1/models)", "model",
                       "missing" if model is None else "invalid_type")
    _only_default(body, "n", 1, "this server returns one choice per request (n must be 1)")
    for name in ("frequency_penalty", "presence_penalty"):
        value = _number(body, name, -2.0, 2.0)
        if value not in (None, 0):
            raise ApiError(400, f"{name} is not supported by this server; use repetition_penalty (> 1 discourages "
                                "repeats)", name, "unsupported")
    if body.get("logit_bias") not in (None, {}):
        raise ApiError(400, "logit_bias is not supported by this server", "logit_bias", "unsupported")
    _typed(body, "user", str)
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", -1, 2 ** 31 - 1)
    penalty = _number(body, "repetition_penalty", 0.0, MAX_REPETITION_PENALTY, low_open=True)
    sampling = SamplingParams(temperature=1.0 if temperature is None else temperature,  # OpenAI's default: 1
                              top_p=1.0 if top_p is None else top_p, top_k=max(top_k or 0, 0),
                              repetition_penalty=1.0 if penalty is None else penalty,
                              seed=_integer(body, "seed", 0, MAX_SEED))
    stream = bool(_typed(body, "stream", bool))
    options = _typed(body, "stream_options", dict) or {}
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise ApiError(400, f"unknown stream_options field {unknown[0]!r} (known: include_usage)", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(400, f"stream_options.include_usage must be a boolean, not {_json_type(include_usage)}",
                       "stream_options", "invalid_type")
    return GenerationRequest(model=model, prompt=prompt, messages=messages,
                             max_tokens=_integer(body, "max_tokens", 1, MAX_NEW_TOKENS), sampling=sampling,
                             stop=_stop(body.get("stop")), stream=stream, include_usage=bool(include_usage),
                             ignore_eos=bool(_typed(body, "ignore_eos", bool)))


# ----------------------------------------------------------------------------- one field each

def _json_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _known(body: dict, fields: set[str]) -> None:
    unknown = sorted(set(body) - fields)
    if unknown:
        raise ApiError(400, f"unrecognized request field {unknown[0]!r}", unknown[0], "unknown_field")


def _only_default(body: dict, name: str, default: Any, message: str) -> None:
    value = body.get(name)
    if value is None or (value == default and type(value) is type(default)):
        return
    raise ApiError(400, f"{message} (got {name}={value!r})"[:300], name, "unsupported")


def _typed(body: dict, name: str, kind: type) -> Any:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"{name} must be {_json_type(kind())}, not {_json_type(value)}", name, "invalid_type")
    return value


def _integer(body: dict, name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be an integer, not {_json_type(value)}", name, "invalid_type")
    if not low <= value <= high:
        raise ApiError(400, f"{name}={value} is outside [{low}, {high}]"[:300], name, "invalid_value")
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ApiError(400, f"{name} must be a number, not {_json_type(value)}", name, "invalid_type")
    try:
        real = float(value)
    except OverflowError:  # an integer beyond float range
        real = math.inf
    if not (math.isfinite(real) and (low < real if low_open else low <= real) and real <= high):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"{name}={value!r} is outside {interval}"[:300], name, "invalid_value")
    return real


def _prompt(prompt: Any, vocab: int) -> str | list[int]:
    """prompt: a string, or token ids; a list holding one of those is taken as it (several: refused)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 1:
            raise ApiError(400, f"prompt holds {len(prompt)} prompts; this server takes one prompt per request",
                           "prompt", "unsupported")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise ApiError(400, "prompt is empty", "prompt", "invalid_value")
        for t in prompt:
            if not isinstance(t, int) or isinstance(t, bool):
                raise ApiError(400, f"prompt token ids must be integers, not {_json_type(t)}", "prompt", "invalid_type")
            if not 0 <= t < vocab:
                raise ApiError(400, f"prompt token id {t} is outside the vocabulary [0, {vocab})"[:300], "prompt",
                               "invalid_value")
        return list(prompt)
    if prompt is None:
        raise ApiError(400, "prompt is required (a string or a list of token ids)", "prompt", "missing")
    raise ApiError(400, f"prompt must be a string or a list of token ids, not {_json_type(prompt)}", "prompt",
                   "invalid_type")


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list):
        raise ApiError(400, f"stop must be a string or a list of strings, not {_json_type(stop)}", "stop",
                       "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise ApiError(400, f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "stop", "invalid_value")
    for s in stops:
        if not isinstance(s, str):
            raise ApiError(400, f"stop strings must be strings, not {_json_type(s)}", "stop", "invalid_type")
        if not s or len(s) > MAX_STOP_CHARS:
            raise ApiError(400, f"a stop string must have 1 to {MAX_STOP_CHARS} characters", "stop", "invalid_value")
    return tuple(dict.fromkeys(stops))


def _messages(messages: Any) -> list[dict]:
    """[{"role", "content": str}]: content given as text parts is joined; developer becomes system."""
    if messages is None:
        raise ApiError(400, "messages is required (a list of {role, content})", "messages", "missing")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content}", "messages",
                       "invalid_type" if not isinstance(messages, list) else "invalid_value")
    if len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"messages holds {len(messages)} messages; at most {MAX_MESSAGES}", "messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object, not {_json_type(m)}", "messages", "invalid_type")
        unknown = sorted(set(m) - {"role", "content", "name"})
        if unknown:
            raise ApiError(400, f"{where} has the field {unknown[0]!r}, which this server does not support "
                                "(text messages only: role, content, name)", "messages", "unsupported")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role must be one of {', '.join(sorted(ROLES))} (got {role!r})"[:300],
                           "messages", "invalid_value")
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise ApiError(400, f"{where}.name must be a string", "messages", "invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": _content(m.get("content"), where)})
    return out


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content: only text parts ({{type: text, text}}) are supported",
                               "messages", "unsupported")
            texts.append(part["text"])
        return "".join(texts)
    raise ApiError(400, f"{where}.content must be a string or a list of text parts, not {_json_type(content)}",
                   "messages", "invalid_type")


# ----------------------------------------------------------------------------- response bodies

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], "usage": use}


def completion_chunk(rid: str, created: int, model: str, text: str, finish: str | None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}


def chat_body(rid: str, created: int, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish}], "usage": use}


def chat_chunk(rid: str, created: int, model: str, delta: dict, finish: str | None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
