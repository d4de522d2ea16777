"""In-flight batching for the Triton model: every request of a paged engine through one scheduler loop.

    Triton's execute (its thread)                  the loop thread (serving/loop.py)
    checked request, prompt ids ── submit ───────▶ ContinuousBatcher: requests join and leave each step
                                                      │ sink: ("token", id) / ("done", reason, stop) / ("error", msg)
    the responder thread ◀──────── outbox ───────────┘
      TextStream per request: a response per new piece of text; the final one with every token id
      and the finish reason; an error response for an engine failure or a stop
      request.is_cancelled()? asked before each text it sends: an empty final response, then
      loop.cancel(id) (pages back at the next step)

The loop thread only steps and queues events: detokenizing and sending (an IPC to the server per
response) happen on the responder thread, so a slow client or a long text never holds a step up.
When the responder falls behind the loop, a request's text of several steps goes out as one response.
All that a request asks of Triton after `execute` (is_cancelled, its responses) happens on the
responder thread, as the one-request workers do it on theirs: Triton 2.51 crashed or hung at shutdown
when another thread asked is_cancelled while responses were being sent.

A request is answered exactly once with a final response: the finish (stop / length), an empty one
when the client cancelled, or an error (the engine failed; the model is stopping). `stop()` drains
briefly (requests that end within `drain_s` finish), then closes the loop: what is left ends with
the model's STOPPING error.

Triton's objects (request, sender) and its responses come in from the model (`Replies`), so this
module imports nothing of Triton's; the tests drive it with stand-ins.
"""

from __future__ import annotations

import functools
import queue
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Sequence

from enginesmith.core.errors import UserError
from enginesmith.runtime.decoding.batching import SchedulerConfig
from enginesmith.runtime.decoding.sampling import SamplingParams
from enginesmith.serving.loop import BatcherLoop, Draining
from enginesmith.serving.text_stream import TextStream

if TYPE_CHECKING:
    from enginesmith.serving.core_client import CoreClient

DEFAULT_MAX_BATCH = 32   # rows per step when the engine sets none (the CPU paged graphs; SmolLM2-135M on 2 cores:
                         # 79 ms a decode step alone, 5.7 ms a row at 32 rows, 7.1 ms at 50)
STEP_TOKENS = 512        # new tokens per step, all rows together (prefill chunks share it)
CHUNK = 64               # prompt tokens per row per step, at most (and at most what the engine's attention takes)


def scheduler_config(model: Any, max_batch: int = 0) -> SchedulerConfig:
    """Rows per step: `max_batch`, else the engine's own (a CUDA paged engine's), else DEFAULT_MAX_BATCH;
    a step budget that decodes every row and still prefills a chunk."""
    rows = max_batch or getattr(model, "max_batch", None) or DEFAULT_MAX_BATCH
    chunk = min(CHUNK, getattr(model, "max_chunk", None) or CHUNK)
    return SchedulerConfig(max_batch=rows, max_tokens=max(rows, chunk, STEP_TOKENS), chunk=chunk)


class Replies(Protocol):
    """The responses the model sends (serving/triton_model.py binds them to Triton's python backend)."""

    def text(self, sender: Any, text: str) -> None: ...
    def final(self, sender: Any, text: str, token_ids: list[int], finish_reason: str) -> None: ...
    def cancelled(self, sender: Any) -> None: ...
    def error(self, sender: Any, message: str, code_name: str) -> None: ...
    def is_cancelled(self, request: Any) -> bool: ...


@dataclass(eq=False)
class _Stream:
    request: Any
    sender: Any
    text: TextStream
    request_id: str | None = None      # set once the loop took it
    tokens: list[int] = field(default_factory=list)
    unsent: str = ""                   # new text not sent yet (sent once per batch of events)
    open: bool = True                  # no final response sent yet: is_cancelled may be asked


class BatchedRequests:
    """The model's requests on one BatcherLoop: submit from Triton's thread, answers from the responder."""

    def __init__(self, loop: BatcherLoop | CoreClient, tokenizer: Any, stop_token_ids: Sequence[int], replies: Replies,
                 log: Any, stopping_message: str):
        self.loop = loop
        self.tokenizer = tokenizer
        self.stop_token_ids = tuple(stop_token_ids)
        self.replies = replies
        self.log = log
        self.stopping_message = stopping_message
        self.stopping = threading.Event()
        self._lock = threading.Lock()       # guards `_open`
        self._submitting = threading.Lock()  # a submit, or the start of `stop`
        self._open: set[_Stream] = set()
        self._outbox: "queue.Queue[tuple[_Stream, tuple] | None]" = queue.Queue()
        self.responder = threading.Thread(target=self._respond, name="enginesmith-responder", daemon=True)
        self.responder.start()

    @property
    def open_requests(self) -> int:
        with self._lock:
            return len(self._open)

    def submit(self, request: Any, sender: Any, prompt: Sequence[int], max_tokens: int,
               sampling: SamplingParams, stop_strings: Sequence[str]) -> None:
        """Queue one checked request. UserError (it cannot run), serving.loop.Overloaded or Draining
        propagate: the caller answers them with an error response."""
        stream = _Stream(request, sender, TextStream(self.tokenizer, self.stop_token_ids, stop_strings))
        with self._submitting:  # `stop` waits for it: then every stream in `_open` is the loop's
            if self.stopping.is_set():
                raise Draining("the model is stopping")
            with self._lock:  # before the loop can post its first event
                self._open.add(stream)
            try:
                handle = self.loop.submit(prompt, self._budget(len(prompt), max_tokens), self.stop_token_ids,
                                          stop_strings, sampling, sink=functools.partial(self._post, stream))
            except BaseException:
                with self._lock:
                    self._open.discard(stream)
                raise
            stream.request_id = handle.request_id

    def _budget(self, prompt_len: int, max_tokens: int) -> int:
        """max_tokens, cut to what the engine's context leaves after the prompt (as the one-request path
        does: the answer then ends with "length"); a UserError when the prompt alone fills it."""
        batcher = self.loop.batcher  # fixed settings only: readable from any thread
        limit = batcher.model.max_positions
        if limit is None:
            return max_tokens
        room = limit - (batcher.chunk - 1) - prompt_len
        if room < 1:
            raise UserError(f"prompt of {prompt_len} tokens does not fit the model's context of {limit} tokens "
                            f"(less {batcher.chunk - 1} for the padding of a step)", "shorten the prompt")
        return min(max_tokens, room)

    def stop(self, drain_s: float) -> None:
        """Take no new requests, let those in flight finish for up to `drain_s`, then close the loop:
        what is left gets the stopping error from the responder, which then ends (join `responder`)."""
        with self._submitting:
            self.stopping.set()
        self.loop.drain(drain_s)
        self.loop.close()
        self._outbox.put(None)

    # ------------------------------------------------------------------ the loop thread
    def _post(self, stream: _Stream, event: tuple) -> None:
        self._outbox.put((stream, event))

    # ------------------------------------------------------------------ the responder thread
    def _respond(self) -> None:
        """Answer events in order. Everything queued is taken at once, and a request's new text from
        several steps goes out as one response: a responder behind the loop catches up in fewer sends."""
        running = True
        while running:
            batch = [self._outbox.get()]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            touched: dict[_Stream, None] = {}
            for item in batch:
                if item is None:
                    running = False
                    break
                stream, event = item
                if stream in self._open:  # else answered already (its text showed a stop string first)
                    self._guarded(stream, self._answer, event)
                    touched[stream] = None
            for stream in touched:
                if stream.unsent and stream in self._open:
                    self._guarded(stream, self._send_text)
        with self._lock:  # stopped: a request the loop never took (submitted as it closed) still gets its answer
            left = list(self._open)
        for stream in left:
            self._close(stream)
            try:
                self.replies.error(stream.sender, self.stopping_message, "UNAVAILABLE")
            except Exception:
                pass

    def _guarded(self, stream: _Stream, answer, *args) -> None:
        try:
            answer(stream, *args)
        except Exception as exc:  # the client went away mid-send: end its request, keep serving
            self.log.log_warn(f"enginesmith: could not answer request {stream.request_id}: "
                              f"{type(exc).__name__}: {exc}")
            self._close(stream)
            if stream.request_id is not None:
                self.loop.cancel(stream.request_id)

    def _send_text(self, stream: _Stream) -> None:
        if self._is_cancelled(stream):  # nothing more to a client that went away
            self._cancelled(stream)
            return
        text, stream.unsent = stream.unsent, ""
        self.replies.text(stream.sender, text)

    def _is_cancelled(self, stream: _Stream) -> bool:
        """request.is_cancelled(): asked on this thread only, where the request's responses are sent, and
        never after its final one (Triton 2.51 frees the request then; asking about it, or asking from
        another thread while a response is being sent, crashed or hung the server at shutdown)."""
        if not stream.open:
            return False
        try:
            return self.replies.is_cancelled(stream.request)
        except Exception:  # the request is gone on the server's side: nothing to cancel
            return False

    def _cancelled(self, stream: _Stream) -> None:
        """The client cancelled: an empty final response now, the request's pages back at the next step."""
        self._close(stream)
        self.log.log_info(f"enginesmith: request {stream.request_id} cancelled by the client after "
                          f"{len(stream.tokens)} tokens")
        self.replies.cancelled(stream.sender)
        self.loop.cancel(stream.request_id)

    def _answer(self, stream: _Stream, event: tuple) -> None:
        kind = event[0]
        if kind == "token":
            stream.tokens.append(int(event[1]))
            stream.unsent += stream.text.push(event[1])
            if stream.text.stopped:  # a stop token or string: the scheduler ends it in the same step
                self._close(stream)
                self.replies.final(stream.sender, stream.unsent, stream.tokens, "stop")
                self.loop.cancel(stream.request_id)  # a no-op unless the text saw the stop string first
        elif kind == "done":
            self._close(stream)
            if event[1] == "cancelled":  # not by its client (that one is closed already): end it empty
                self.replies.cancelled(stream.sender)
            else:
                self.replies.final(stream.sender, stream.unsent + stream.text.finish(), stream.tokens, event[1])
        else:  # ("error", message): the engine failed, or the loop was closed
            self._close(stream)
            if stream.unsent:
                self._send_text(stream)
            if self.stopping.is_set():
                self.replies.error(stream.sender, self.stopping_message, "UNAVAILABLE")
            else:
                self.replies.error(stream.sender, f"internal error: {event[1]}", "INTERNAL")

    def _close(self, stream: _Stream) -> None:
        """Before a request's final response: from here on nobody asks Triton about it."""
        stream.open = False
        with self._lock:
            self._open.discard(stream)
