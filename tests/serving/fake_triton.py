"""Stand-ins for Triton's python backend (`triton_python_backend_utils`, which exists only inside
Triton's stub process), enough to drive enginesmith/serving/triton_model.TritonPythonModel in-process: requests
with input tensors, response senders that record what the model sent, a switchable is_model_ready.

The real server is exercised by test_triton_server.py and test_triton_batched_server.py; these
stand-ins make the model's own logic (batching, cancel, overload, unload) fast and deterministic.
"""

from __future__ import annotations

import json
import sys
import threading
import types
from pathlib import Path

import numpy as np

FINAL = 1


class TritonError:
    UNAVAILABLE, INVALID_ARG, INTERNAL = "UNAVAILABLE", "INVALID_ARG", "INTERNAL"

    def __init__(self, message: str, code: str | None = None) -> None:
        self.message, self.code = message, code


class Tensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self.name, self.array = name, array

    def as_numpy(self) -> np.ndarray:
        return self.array


class InferenceResponse:
    def __init__(self, output_tensors: list, error: TritonError | None = None) -> None:
        self.outputs = {t.name: t.array for t in output_tensors}
        self.error = error


class Sender:
    """Records responses; `result()` waits for the final one and sums the stream up."""

    def __init__(self) -> None:
        self.responses: list[InferenceResponse | None] = []
        self.done = threading.Event()
        self.first = threading.Event()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        assert not self.done.is_set(), "a response after the final one"
        self.responses.append(response)
        self.first.set()
        if flags & FINAL:
            self.done.set()

    def result(self, timeout: float = 60.0) -> dict:
        """{"text", "token_ids", "finish_reason", "chunks"}, {"error", "code"} or {"cancelled": True}."""
        assert self.done.wait(timeout), "no final response"
        last = self.responses[-1]
        if last is None:
            return {"cancelled": True, "chunks": len(self.responses) - 1}
        if last.error is not None:
            return {"error": last.error.message, "code": last.error.code, "chunks": len(self.responses) - 1}
        text = "".join(r.outputs["text_output"][0].decode() for r in self.responses)
        return {"text": text, "token_ids": last.outputs["token_ids"].tolist(),
                "finish_reason": last.outputs["finish_reason"][0].decode(), "chunks": len(self.responses)}


class Request:
    def __init__(self, **inputs) -> None:
        self.inputs = {}
        for name, value in inputs.items():
            if isinstance(value, str):
                self.inputs[name] = np.array([value.encode()], dtype=np.object_)
            elif isinstance(value, list):
                self.inputs[name] = np.array([v.encode() for v in value], dtype=np.object_)
            else:
                self.inputs[name] = np.array([value])
        self.sender = Sender()
        self.cancelled = False

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        return self.cancelled


def module() -> types.ModuleType:
    """A fresh `triton_python_backend_utils` stand-in (its `ready` flag answers is_model_ready)."""
    pb = types.ModuleType("triton_python_backend_utils")
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.TritonError, pb.Tensor, pb.InferenceResponse = TritonError, Tensor, InferenceResponse
    pb.ready = True
    pb.log: list[str] = []
    pb.Logger = types.SimpleNamespace(log_info=pb.log.append, log_warn=pb.log.append, log_error=pb.log.append)
    pb.get_input_tensor_by_name = lambda request, name: (Tensor(name, request.inputs[name])
                                                         if name in request.inputs else None)
    pb.is_model_ready = lambda model_name, model_version: pb.ready
    return pb


def start_model(monkeypatch, params: dict[str, str], repository: Path):
    """(TritonPythonModel initialized with config parameters `params`, its pb stand-in)."""
    pb = module()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    from enginesmith.serving.triton_model import TritonPythonModel

    model = TritonPythonModel()
    model.initialize({"model_name": "m", "model_version": "1", "model_repository": str(repository),
                      "model_config": json.dumps({"parameters": {k: {"string_value": v} for k, v in params.items()}})})
    return model, pb
