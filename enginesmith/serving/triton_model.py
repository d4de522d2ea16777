"""The Triton python-backend model that serves an engine directory (see serving/triton_repository.py).

Triton calls `execute` with a list of requests; this model is decoupled, so `execute` only hands
them on and returns. Each request streams: one response per new piece of text, then a final
response with every token id and the finish reason. Who generates depends on the engine:

    paged KV cache     one scheduler loop for every request (serving/triton_batched.py): requests
                       join and leave the running batch each step; beyond MAX_WAITING queued, a new
                       request gets an UNAVAILABLE "overloaded" error; a client's cancel frees its pages.
                       The loop runs in this process, or (ENGINE_CORE; auto: on a GPU) in an engine
                       core process of its own, a child of this one (serving/engine_core.py, as serve)
    any other engine   WORKERS threads (config.pbtxt, default 1), each one request at a time

A request with a bad parameter gets an error response (the stub keeps running); so does one that
fails inside generation.

Requests are untrusted input: serving/triton_requests.py checks them (`request_settings`,
`prompt_ids`) before anything runs.

Stopping: when Triton unloads the model (the server stops, or an explicit unload) open streams end
between tokens and queued requests are answered with UNAVAILABLE, so the stub finalizes cleanly
within the server's exit timeout (see TritonPythonModel).

The model needs `triton_python_backend_utils`, which exists only inside Triton's stub process
(tests/serving/fake_triton.py stands in for it).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from enginesmith.core import engine_dir
from enginesmith.core.errors import UserError
from enginesmith.runtime.text.chat import stop_token_ids
from enginesmith.runtime.decoding.generate import GenerationConfig, stream
from enginesmith.runtime.engines.ort_engine import resolve_device
from enginesmith.runtime.load import open_engine, paged_model
from enginesmith.runtime.protocols import LoadedEngine
from enginesmith.runtime.text.tokenizer import Tokenizer
from enginesmith.serving.core_client import CoreClient
from enginesmith.serving.engine_core import CoreSpec, core_placement
from enginesmith.serving.loop import BatcherLoop, Draining, Overloaded
from enginesmith.serving.triton_batched import CHUNK, DEFAULT_MAX_BATCH, BatchedRequests, scheduler_config
from enginesmith.serving.triton_repository import INPUTS, ModelOptions, is_paged
from enginesmith.serving.triton_requests import prompt_ids, request_settings


def instance_gpu(args: Mapping[str, Any], visible: str | None) -> str | None:
    """CUDA_VISIBLE_DEVICES for a model instance Triton placed on a GPU (instance_group KIND_GPU, or
    Triton's default of one instance per GPU), None for a CPU instance. Each instance is a process of
    its own, so the model pins it to its GPU: device `model_instance_device_id` as the server numbers
    them, that is an entry of the server's own CUDA_VISIBLE_DEVICES when one is set."""
    if str(args.get("model_instance_kind", "")).upper() != "GPU":
        return None
    index = int(args.get("model_instance_device_id", 0))
    names = [v.strip() for v in (visible or "").split(",") if v.strip()]
    if not names:
        return str(index)
    if not 0 <= index < len(names):
        raise UserError(f"Triton placed this model instance on GPU {index}, but CUDA_VISIBLE_DEVICES={visible!r} "
                        f"names {len(names)}", "fix the instance_group gpus in config.pbtxt")
    return names[index]


def _open(path: Path, options: ModelOptions, params: Mapping[str, str]) -> Any:
    """LoadedEngine for an ONNX Runtime or TensorRT engine directory, through the runtime's one door
    (a CUDA paged engine opens with MAX_BATCH rows and NUM_PAGES pages, when set)."""
    plugins = [p for p in params.get("TRT_PLUGINS", "").split(",") if p]
    return open_engine(path, device=options.device, threads=options.threads or None,
                       verify_hashes=options.verify_hashes, plugin_libraries=plugins,
                       max_batch=options.max_batch or None, num_pages=options.num_pages or None)


def _core_spec(path: Path, options: ModelOptions) -> CoreSpec | None:
    """How to start an engine core process for this model (ENGINE_CORE: auto is a process on a GPU), or
    None to open the engine here: a paged ONNX Runtime engine only (a TensorRT engine, and an engine
    without paged KV, stay in this process)."""
    device = resolve_device(options.device)
    if core_placement(options.engine_core, device) != "process":
        return None
    manifest = engine_dir.read_manifest(path)
    if not is_paged(manifest) or manifest.backend.name != "onnxruntime":
        return None
    return CoreSpec(str(path), device, options.threads or None, options.max_batch or None,
                    options.num_pages or None, chunk=CHUNK, cpu_max_batch=DEFAULT_MAX_BATCH,
                    verify_hashes=options.verify_hashes)


def _open_core(spec: CoreSpec, options: ModelOptions) -> tuple[LoadedEngine, CoreClient, str]:
    """The engine core process on `spec` (it verifies and opens the engine) and, here, what the model
    needs besides: the manifest and the tokenizer."""
    client = CoreClient.start(spec, options.max_waiting)
    path = Path(spec.engine)
    # no engine here: the core runs it (the model reads only the manifest and the tokenizer of a paged engine)
    loaded = LoadedEngine(path, engine_dir.read_manifest(path), None, Tokenizer(path / "tokenizer"))  # type: ignore[arg-type]
    info = client.info
    return loaded, client, (f"an engine core process (pid {client.pid}; {info.max_batch} rows per step, "
                            f"{info.num_pages - 1} KV pages, up to {options.max_waiting} waiting)")


# While requests are open, how often to ask Triton whether this model is still ready (see _watch).
UNLOAD_POLL_S = 0.25
# On an unload, how long a paged engine's requests in flight may run on before they are ended.
DRAIN_S = 1.0
# How long finalize waits for the model's threads, all together.
FINALIZE_JOIN_S = 5.0
STOPPING = "the model is being unloaded (an unload or a server shutdown); this answer is incomplete"


class _Stopping(Exception):
    """Raised between tokens when the model is being unloaded."""


class TritonReplies:
    """The model's calls into Triton's python backend after `execute` (`pb`: triton_python_backend_utils):
    its responses, is_cancelled and is_model_ready, one at a time.

    Each of them is a message to the server and a wait for its answer. Triton 2.51's stub does not take
    them from several threads at once: with a worker sending a stream's responses while the unload
    watcher asked is_model_ready, a SIGTERM crashed the server (boost lock_exception) or hung it, about
    one time in five on a loaded machine. One lock makes them take turns."""

    def __init__(self, pb: Any, log: Any) -> None:
        self.pb, self.log = pb, log
        self._turn = threading.Lock()

    def _response(self, text: str, token_ids: list[int] | None = None, finish: str | None = None) -> Any:
        tensors = [self.pb.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
        if token_ids is not None:
            tensors.append(self.pb.Tensor("token_ids", np.asarray(token_ids, dtype=np.int64)))
        if finish is not None:
            tensors.append(self.pb.Tensor("finish_reason", np.array([finish.encode()], dtype=np.object_)))
        return self.pb.InferenceResponse(output_tensors=tensors)

    def _send(self, sender: Any, response: Any = None, final: bool = False) -> None:
        flags = self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        with self._turn:
            if response is None:
                sender.send(flags=flags)
            else:
                sender.send(response, flags=flags)

    def text(self, sender: Any, text: str) -> None:
        self._send(sender, self._response(text))

    def final(self, sender: Any, text: str, token_ids: list[int], finish_reason: str) -> None:
        self._send(sender, self._response(text, token_ids, finish_reason), final=True)

    def cancelled(self, sender: Any) -> None:
        self._send(sender, final=True)

    def error(self, sender: Any, message: str, code_name: str) -> None:
        error_type = self.pb.TritonError
        code = getattr(error_type, code_name, None)
        error = error_type(message, code) if code is not None else error_type(message)
        try:
            self._send(sender, self.pb.InferenceResponse(output_tensors=[], error=error), final=True)
        except Exception as exc:  # the client went away: nothing left to tell
            self.log.log_warn(f"enginesmith: could not send the error response: {exc}")

    def is_cancelled(self, request: Any) -> bool:
        with self._turn:
            return bool(request.is_cancelled())

    def model_ready(self, name: str, version: str) -> bool:
        """pb.is_model_ready; an exception (the server is stopping: "Server not ready") propagates."""
        with self._turn:
            return bool(self.pb.is_model_ready(model_name=name, model_version=version))


class TritonPythonModel:
    """Triton's entry points: initialize, execute, finalize.

    Serving. A paged engine: `execute` checks each request and submits it to one scheduler loop
    (serving/triton_batched.py) that batches all of them. Any other engine: `execute` queues the
    requests and WORKERS threads each generate one at a time (`_work`).

    Stopping. Triton calls `finalize` only once no response sender is left open, so an open stream
    would hold the model (and the server's shutdown) until it ends or --exit-timeout-secs runs out,
    and the stub would then be killed, leaving its shared memory and /tmp/python_env_* behind. So a
    watcher thread asks Triton, while requests are open, whether this model is still ready; on an
    unload (server stop or explicit unload) it sets `stopping`: workers end their streams between
    tokens, and every queued request, with an UNAVAILABLE error (the scheduler loop: requests in
    flight get DRAIN_S to finish, then the same error). `finalize` does the same, then joins the
    threads (FINALIZE_JOIN_S in all).
    """

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils  # exists only inside Triton's stub process

        gpu = instance_gpu(args, os.environ.get("CUDA_VISIBLE_DEVICES"))
        if gpu is not None:  # before anything opens CUDA here: the engine sees that GPU alone, as device 0
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
        self.pb = pb_utils
        self.log = pb_utils.Logger
        self.replies = TritonReplies(pb_utils, self.log)
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
        core = _core_spec(path, self.options)
        self.loaded: LoadedEngine
        loop: BatcherLoop | CoreClient | None
        self.loaded, loop, how = _open_core(core, self.options) if core else self._open_here(path, params)
        # A TensorRT engine has one execution context and static buffers: one generation at a time.
        trt = self.loaded.manifest.backend.name == "tensorrt"
        self.exclusive: Any = threading.Lock() if trt else contextlib.nullcontext()
        self.stop_ids = stop_token_ids(self.loaded.tokenizer, self.loaded.manifest)
        self.requests: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.lock = threading.Lock()  # guards `open_requests` and the stopping/queue hand-over
        self.open_requests = 0
        self.batched: BatchedRequests | None = None
        self.workers: list[threading.Thread] = []
        if loop is not None:
            self.batched = BatchedRequests(loop, self.loaded.tokenizer, self.stop_ids, self.replies, self.log, STOPPING)
        else:
            self.workers = [threading.Thread(target=self._work, name=f"enginesmith-worker-{i}", daemon=True)
                            for i in range(self.options.workers)]
            how = f"{len(self.workers)} worker(s), one request each at a time"
        self.watcher = threading.Thread(target=self._watch, name="enginesmith-unload-watch", daemon=True)
        for thread in [*self.workers, self.watcher]:
            thread.start()
        where = f" on GPU {gpu}" if gpu is not None else ""
        special = "; request text may spell special tokens" if self.options.special_tokens_in_text else ""
        self.log.log_info(f"enginesmith: serving {path}{where} with {how}{special}")

    def _open_here(self, path: Path, params: Mapping[str, str]) -> tuple[LoadedEngine, BatcherLoop | None, str]:
        """The engine opened in this process: (loaded, its scheduler loop if paged else None, how it serves)."""
        loaded = _open(path, self.options, params)
        if not is_paged(loaded.manifest):
            return loaded, None, ""
        model = paged_model(loaded, self.options.num_pages or None)
        scheduler = scheduler_config(model, self.options.max_batch)
        loop = BatcherLoop(model, scheduler, max_waiting=self.options.max_waiting, decode=loaded.tokenizer.decode)
        return loaded, loop, (f"one scheduler loop ({scheduler.max_batch} rows per step, {model.num_pages - 1} "
                              f"KV pages, up to {self.options.max_waiting} waiting)")

    def execute(self, requests: list) -> None:
        if self.batched is not None:
            for request in requests:
                self._submit(request)
            return None
        with self.lock:
            stopping = self.stopping.is_set()
            if not stopping:
                self.open_requests += len(requests)
                for request in requests:
                    self.requests.put(request)
        if stopping:
            for request in requests:
                self.replies.error(request.get_response_sender(), STOPPING, "UNAVAILABLE")
        return None

    def finalize(self) -> None:
        self._stop("finalize")
        deadline = time.monotonic() + FINALIZE_JOIN_S
        threads = [*self.workers, self.watcher] + ([self.batched.responder] if self.batched is not None else [])
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            self.log.log_warn(f"enginesmith: {', '.join(alive)} still busy after {FINALIZE_JOIN_S:.0f} s")

    # ------------------------------------------------------------------ stopping

    def _stop(self, why: str) -> None:
        """Set `stopping` (once); end every request: the loop's after DRAIN_S, the workers' queue now."""
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
        if self.batched is not None:
            self.batched.stop(DRAIN_S)
        for request in pending:
            if request is not None:
                self.replies.error(request.get_response_sender(), STOPPING, "UNAVAILABLE")
                self._closed()

    def _open_count(self) -> int:
        return self.batched.open_requests if self.batched is not None else self.open_requests

    def _watch(self) -> None:
        """Poll `is_model_ready` while requests are open: an unload has begun when it says no (or the
        server, exiting, refuses to answer). Idle, the model holds nothing that delays an unload."""
        if getattr(self.pb, "is_model_ready", None) is None:
            self.log.log_warn("enginesmith: this python backend has no is_model_ready; open streams will hold "
                              "an unload until they end")
            return
        while not self.stopping.wait(UNLOAD_POLL_S):
            if not self._open_count():
                continue
            try:
                ready = self.replies.model_ready(self.model_name, self.model_version)
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

    def _values(self, request: Any) -> dict[str, Any]:
        """The request's input tensors as {name: numpy array} (the absent optional ones left out)."""
        values = {}
        for t in INPUTS:
            tensor = self.pb.get_input_tensor_by_name(request, t.name)
            if tensor is not None:
                values[t.name] = tensor.as_numpy()
        return values

    def _submit(self, request: Any) -> None:
        """A paged engine: check one request and hand it to the scheduler loop, or answer its error."""
        sender = request.get_response_sender()
        batched = self.batched
        assert batched is not None, "_submit serves a paged engine (execute checks)"
        try:
            if self.stopping.is_set():
                raise Draining()
            settings = request_settings(self._values(request), self.options.max_tokens)
            ids = prompt_ids(self.loaded.tokenizer, settings, self.options.special_tokens_in_text)
            batched.submit(request, sender, ids, settings.max_tokens, settings.sampling, settings.stop)
        except UserError as exc:
            self.replies.error(sender, str(exc), "INVALID_ARG")
        except Overloaded as exc:
            self.replies.error(sender, f"the model is overloaded: {exc}", "UNAVAILABLE")
        except Draining:
            failure = getattr(batched.loop, "failure", None)  # an engine core that died
            self.replies.error(sender, f"the model cannot serve: {failure}" if failure else STOPPING, "UNAVAILABLE")
        except Exception as exc:  # never let one request take the stub down
            self.log.log_error(f"enginesmith: request failed: {type(exc).__name__}: {exc}")
            self.replies.error(sender, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL")

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
                self.replies.error(sender, STOPPING, "UNAVAILABLE")
            except UserError as exc:
                self.replies.error(sender, str(exc), "INVALID_ARG")
            except Exception as exc:  # never let one request take the stub down
                self.log.log_error(f"enginesmith: request failed: {type(exc).__name__}: {exc}")
                self.replies.error(sender, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL")
            finally:
                self._closed()

    def _serve(self, request: Any, sender: Any) -> None:
        """One request, alone, through runtime.decoding.generate.stream (engines without paged KV)."""
        settings = request_settings(self._values(request), self.options.max_tokens)
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
            if self.replies.is_cancelled(request):
                self.replies.cancelled(sender)
                return
            if deltas[0]:
                self.replies.text(sender, deltas[0])
        self.replies.final(sender, "", completion.token_ids, completion.finish_reason)
