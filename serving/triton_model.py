"""The Triton python-backend model that serves an engine directory (see serving/triton_repository.py).

Triton calls `execute` with a list of requests; this model is decoupled, so `execute` only queues
them and returns. Worker threads (WORKERS in config.pbtxt, default 1) take requests one at a time
and stream: one response per new piece of text, then a final response with every token id and
the finish reason. A request with a bad parameter gets an error response (the stub keeps
running); so does one that fails inside generation.

Requests are untrusted input:
  - numbers are checked as Python ints and floats, as sent (int64 on the wire), against the ranges
    in INT_RANGES and FLOAT_RULES, NaN and infinities refused, before anything could narrow them;
  - special-token spellings in text_input and system are encoded as text (`prompt_ids`), unless
    the deployer set SPECIAL_TOKENS_IN_TEXT=1 (`enginesmith triton --allow-special-tokens-in-text`).

Stopping: when Triton unloads the model (the server stops, or an explicit unload) open streams end
between tokens and queued requests are answered with UNAVAILABLE, so the stub finalizes cleanly
within the server's exit timeout (see TritonPythonModel).

`request_settings` and `prompt_ids` (pure, no Triton import) turn the request's tensors into
generation settings and token ids and are what the unit tests exercise; the rest needs
`triton_python_backend_utils`, which exists only inside Triton's stub process.
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from enginesmith.serving.triton_repository import DEFAULT_MAX_TOKENS, INPUTS, ModelOptions
from enginesmith.core.errors import UserError
from enginesmith.runtime.chat import encode_prompt, stop_token_ids
from enginesmith.runtime.generate import MAX_NEW_TOKENS, GenerationConfig, stream
from enginesmith.runtime.load import open_engine
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


def _open(path: Path, options: ModelOptions, params: Mapping[str, str]) -> Any:
    """LoadedEngine for an ONNX Runtime or TensorRT engine directory, through the runtime's one door."""
    plugins = [p for p in params.get("TRT_PLUGINS", "").split(",") if p]
    return open_engine(path, device=options.device, threads=options.threads or None,
                       verify_hashes=options.verify_hashes, plugin_libraries=plugins)


# While requests are open, how often to ask Triton whether this model is still ready (see _watch).
UNLOAD_POLL_S = 0.25
# How long finalize waits for the workers, all together.
FINALIZE_JOIN_S = 5.0
STOPPING = "the model is being unloaded (an unload or a server shutdown); this answer is incomplete"


class _Stopping(Exception):
    """Raised between tokens when the model is being unloaded."""


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize.

    Stopping. Triton calls `finalize` only once no response sender is left open, so an open stream
    would hold the model (and the server's shutdown) until it ends or --exit-timeout-secs runs out,
    and the stub would then be killed, leaving its shared memory and /tmp/python_env_* behind. So a
    watcher thread asks Triton, while requests are open, whether this model is still ready; on an
    unload (server stop or explicit unload) it sets `stopping`: workers end their streams between
    tokens, and every queued request, with an UNAVAILABLE error. `finalize` does the same, then joins
    the workers (FINALIZE_JOIN_S in all).
    """

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # exists only inside Triton's stub process

        self.pb = pb_utils
        self.log = pb_utils.Logger
        self.model_name = args["model_name"]
        self.model_version = str(args.get("model_version", ""))
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
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # guards `open_requests` and the stopping/queue hand-over
        self.open_requests = 0
        self.workers = [threading.Thread(target=self._work, name=f"enginesmith-worker-{i}", daemon=True)
                        for i in range(self.options.workers)]
        self.watcher = threading.Thread(target=self._watch, name="enginesmith-unload-watch", daemon=True)
        for thread in [*self.workers, self.watcher]:
            thread.start()
        special = "; request text may spell special tokens" if self.options.special_tokens_in_text else ""
        self.log.log_info(f"enginesmith: serving {path} with {len(self.workers)} worker(s){special}")

    def execute(self, requests: list) -> None:
        with self.lock:
            stopping = self.stopping.is_set()
            if not stopping:
                self.open_requests += len(requests)
                for request in requests:
                    self.requests.put(request)
        if stopping:
            for request in requests:
                self._fail(request.get_response_sender(), STOPPING, "UNAVAILABLE")
        return None

    def finalize(self) -> None:
        self._stop("finalize")
        deadline = time.monotonic() + FINALIZE_JOIN_S
        for thread in [*self.workers, self.watcher]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in self.workers if t.is_alive()]
        if alive:
            self.log.log_warn(f"enginesmith: {', '.join(alive)} still busy after {FINALIZE_JOIN_S:.0f} s")

    # ------------------------------------------------------------------ stopping

    def _stop(self, why: str) -> None:
        """Set `stopping` (once), answer every queued request with UNAVAILABLE, release the workers."""
        with self.lock:
            if self.stopping.is_set():
                return
            self.stopping.set()
            pending = []
            while True:
                try:
                    pending.append(self.requests.get_nowait())
                except queue.Empty:
                    break
            for _ in self.workers:
                self.requests.put(None)
        self.log.log_info(f"enginesmith: stopping ({why}); ending open requests")
        for request in pending:
            if request is not None:
                self._fail(request.get_response_sender(), STOPPING, "UNAVAILABLE")
                self._closed()

    def _watch(self) -> None:
        """Poll `is_model_ready` while requests are open: an unload has begun when it says no (or the
        server, exiting, refuses to answer). Idle, the model holds nothing that delays an unload."""
        is_ready = getattr(self.pb, "is_model_ready", None)
        if is_ready is None:
            self.log.log_warn("enginesmith: this python backend has no is_model_ready; open streams will hold "
                              "an unload until they end")
            return
        while not self.stopping.wait(UNLOAD_POLL_S):
            if not self.open_requests:
                continue
            try:
                ready = is_ready(model_name=self.model_name, model_version=self.model_version)
            except Exception as exc:  # "Server not ready": the server is stopping
                self.log.log_info(f"enginesmith: is_model_ready failed ({exc})")
                ready = False
            if not ready:
                self._stop("the model is being unloaded")
                return

    def _closed(self) -> None:
        with self.lock:
            self.open_requests -= 1

    # ------------------------------------------------------------------ per request

    def _work(self) -> None:
        while True:
            request = self.requests.get()
            if request is None:
                return
            sender = request.get_response_sender()
            try:
                if self.stopping.is_set():
                    raise _Stopping()
                with self.exclusive:
                    self._serve(request, sender)
            except _Stopping:
                self._fail(sender, STOPPING, "UNAVAILABLE")
            except UserError as exc:
                self._fail(sender, str(exc), "INVALID_ARG")
            except Exception as exc:  # never let one request take the stub down
                self.log.log_error(f"enginesmith: request failed: {type(exc).__name__}: {exc}")
                self._fail(sender, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL")
            finally:
                self._closed()

    def _fail(self, sender: Any, message: str, code_name: str) -> None:
        error_type = self.pb.TritonError
        code = getattr(error_type, code_name, None)
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
        ids = prompt_ids(loaded.tokenizer, settings, self.options.special_tokens_in_text)
        gen = stream(loaded.engine, loaded.tokenizer, [ids], config, loaded.pad_id)
        while True:
            try:
                deltas = next(gen)
            except StopIteration as end:
                completion = end.value[0]
                break
            if self.stopping.is_set():  # dropping the generator ends it
                raise _Stopping()
            if request.is_cancelled():
                sender.send(flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            if deltas[0]:
                sender.send(self._response(deltas[0]))
        sender.send(self._response("", completion.token_ids, completion.finish_reason),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
