"""The Triton python-backend model that serves an engine directory (see deploy/triton.py).

Triton calls `execute` with a list of requests; this model is decoupled, so `execute` only queues
them and returns. Worker threads (WORKERS in config.pbtxt, default 1) take requests one at a time
and stream: one response per new piece of text, then a final response with every token id and
the finish reason. A request with a bad parameter gets an error response (the stub keeps
running); so does one that fails inside generation.

`request_settings` (pure, no Triton import) turns the request's tensors into generation settings
and is what the unit tests exercise; the rest needs `triton_python_backend_utils`, which exists only
inside Triton's stub process.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from enginesmith.deploy.triton import DEFAULT_MAX_TOKENS, INPUTS, ModelOptions
from enginesmith.errors import UserError
from enginesmith.runtime.sampling import SamplingParams


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


def _number(value: Any, name: str, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, (bytes, str, np.bytes_, np.str_)) or not np.isscalar(value):
        raise UserError(f"input {name!r}={value!r} is not a number", f"send {name} as a number")
    item: Any = np.asarray(value).item()
    if kind is int:
        if float(item) != int(item):
            raise UserError(f"input {name!r}={value!r} is not an integer", f"send {name} as an integer")
        return int(item)
    return float(item)


def request_settings(values: Mapping[str, Any], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> RequestSettings:
    """Validate one request's tensors ({name: numpy array}); raise UserError naming the bad input."""
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
    max_tokens = _number(_one(values, "max_tokens"), "max_tokens", int)
    if max_tokens is None:
        max_tokens = default_max_tokens
    if max_tokens < 1:
        raise UserError(f"invalid max_tokens={max_tokens}", "max_tokens must be an integer >= 1")
    params: dict[str, Any] = {}
    for name, kind in (("temperature", float), ("top_k", int), ("top_p", float),
                       ("repetition_penalty", float), ("seed", int)):
        value = _number(_one(values, name), name, kind)
        if value is not None:
            params[name] = value
    if params.get("seed") is not None and params["seed"] < 0:
        raise UserError(f"invalid seed={params['seed']}", "seed must be an integer >= 0")
    sampling = SamplingParams(**params)  # raises UserError on a bad value
    stop_values = values.get("stop")
    stop = tuple(_text(s, "stop") for s in np.asarray(stop_values).reshape(-1)) if stop_values is not None else ()
    if any(not s for s in stop):
        raise UserError("empty stop string", "leave out empty strings from stop")
    return RequestSettings(prompt=prompt, raw=bool(raw) if raw is not None else False,
                           system=_text(system, "system") if system is not None else None,
                           max_tokens=max_tokens, sampling=sampling, stop=stop)


def _open(path: Path, options: ModelOptions, params: Mapping[str, str]) -> Any:
    """LoadedEngine for an ONNX Runtime or TensorRT engine directory."""
    from enginesmith.runtime.load import open_engine

    plugins = [p for p in params.get("TRT_PLUGINS", "").split(",") if p]
    return open_engine(path, device=options.device, threads=options.threads or None,
                       verify_hashes=options.verify_hashes, plugin_libraries=plugins)


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils

        from enginesmith.runtime.chat import stop_token_ids

        self.pb = pb_utils
        self.log = pb_utils.Logger
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        self.options = ModelOptions.from_parameters(params)
        path = Path(self.options.engine)
        if not path.is_absolute():  # relative to the model directory (copy_engine=True)
            path = Path(args["model_repository"]) / path
        model_dir = Path(args["model_repository"])
        for key in ("TRT_PLAN", "TRT_PLUGINS"):  # relative paths likewise
            if params.get(key):
                params[key] = ",".join(p if Path(p).is_absolute() else str(model_dir / p)
                                       for p in params[key].split(","))
        self.loaded = _open(path, self.options, params)
        # A TensorRT engine has one execution context and static buffers: one generation at a time.
        trt = self.loaded.manifest.backend.name == "tensorrt"
        self.exclusive: Any = threading.Lock() if trt else contextlib.nullcontext()
        self.stop_ids = stop_token_ids(self.loaded.tokenizer, self.loaded.manifest)
        self.requests: queue.Queue = queue.Queue()
        self.workers = [threading.Thread(target=self._work, name=f"enginesmith-worker-{i}", daemon=True)
                        for i in range(self.options.workers)]
        for worker in self.workers:
            worker.start()
        self.log.log_info(f"enginesmith: serving {path} with {len(self.workers)} worker(s)")

    def execute(self, requests: list) -> None:
        for request in requests:
            self.requests.put(request)
        return None

    def finalize(self) -> None:
        for _ in self.workers:
            self.requests.put(None)
        for worker in self.workers:
            worker.join(timeout=30)

    # ------------------------------------------------------------------ per request

    def _work(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            sender = request.get_response_sender()
            try:
                with self.exclusive:
                    self._serve(request, sender)
            except UserError as exc:
                self._fail(sender, str(exc), invalid=True)
            except Exception as exc:  # never let one request take the stub down
                self.log.log_error(f"enginesmith: request failed: {type(exc).__name__}: {exc}")
                self._fail(sender, f"internal error: {type(exc).__name__}: {exc}", invalid=False)

    def _fail(self, sender: Any, message: str, invalid: bool) -> None:
        error_type = self.pb.TritonError
        code = getattr(error_type, "INVALID_ARG" if invalid else "INTERNAL", None)
        error = error_type(message, code) if code is not None else error_type(message)
        try:
            sender.send(self.pb.InferenceResponse(output_tensors=[], error=error),
                        flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        except Exception as exc:  # the client went away: nothing left to tell
            self.log.log_warn(f"enginesmith: could not send the error response: {exc}")

    def _response(self, text: str, token_ids: list[int] | None = None, finish: str | None = None) -> Any:
        tensors = [self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if token_ids is not None:
            tensors.append(self.pb.Tensor("token_ids", np.asarray(token_ids, dtype=np.int64)))
        if finish is not None:
            tensors.append(self.pb.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _serve(self, request: Any, sender: Any) -> None:
        from enginesmith.runtime.chat import encode_prompt
        from enginesmith.runtime.generate import GenerationConfig, stream

        values = {}
        for t in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, t.name)
            if tensor is not None:
                values[t.name] = tensor.as_numpy()
        settings = request_settings(values, self.options.max_tokens)
        loaded = self.loaded
        config = GenerationConfig(max_new_tokens=settings.max_tokens, sampling=settings.sampling,
                                  stop_token_ids=self.stop_ids, stop_strings=settings.stop,
                                  max_positions=loaded.max_positions)
        ids = encode_prompt(loaded.tokenizer, settings.prompt, raw=settings.raw, system=settings.system)
        gen = stream(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id)
        while True:
            try:
                deltas = next(gen)
            except StopIteration as end:
                completion = end.value[0]
                break
            if request.is_cancelled():  # dropping the generator ends it
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if deltas[0]:
                sender.send(self._response(deltas[0]))
        sender.send(self._response("", completion.token_ids, completion.finish_reason),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
