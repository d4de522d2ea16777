"""`enginesmith serve`'s HTTP front door: the OpenAI API over the one BatcherLoop (Starlette, ASGI), in
this process or in an engine core process (serving/core_client.py's CoreClient, the same interface).

    POST /v1/completions        ─┐ auth ─ body (size-bounded) ─ parse + validate (openai_protocol)
    POST /v1/chat/completions   ─┘   ─ encode (chat template | text | token ids; in a worker thread)
                                     ─ loop.submit(ids, ..., sink) ══ the loop thread steps the batch ══╗
         SSE chunks (stream: true; sse_chunks) or one JSON body ◀── TextStream ◀── EventRelay ◀── sink ◀═══╝
    GET  /v1/models, /v1/models/{model}, /health (503 while draining), /metrics (serving/metrics.py)

Events cross from the loop thread to the event loop in EventRelay's batches (one call_soon_threadsafe
per step), into each Generation's list of events (a future wakes its reader).
A client that goes away (the ASGI http.disconnect, or a failed send), mid-stream or while a whole
answer is being made, cancels its request: its KV pages go back at the loop's next step.

Refusals are OpenAI-style JSON, `{"error": {"message", "type", "param", "code"}}`, never a traceback:
400 a bad field (openai_protocol), a prompt too long for the engine or over max_prompt_bytes (counted
before any tokenizer work, so a huge prompt costs next to nothing); 401 a missing or wrong key
(`Authorization: Bearer`, compared in constant time; /health and /metrics are open); 404 an unknown
model or route; 405; 413 a body over max_body_bytes; 429 too many requests waiting (Retry-After);
503 draining (Retry-After); 500 an engine failure or a bug of ours (the message only).

Defaults: max_tokens 16 for /v1/completions (OpenAI's), the room left in the context for chat;
temperature 1 (OpenAI's; send 0 for greedy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from enginesmith.core.errors import EngineError, UserError
from enginesmith.runtime.text.chat import encode_chat, encode_prompt, stop_token_ids
from enginesmith.runtime.decoding.generate import MAX_NEW_TOKENS
from enginesmith.serving.loop import BatcherLoop, Draining, Overloaded
from enginesmith.serving.metrics import ServerMetrics
from enginesmith.serving.http_guard import (api_error, check_api_key, disconnected, http_error, read_body,
                                            send_until_disconnect)
from enginesmith.serving.openai_protocol import (ApiError, GenerationRequest, chat_body, completion_body, error_body,
                                                 parse_chat, parse_completion, parse_json, usage)
from enginesmith.serving.sse_chunks import DONE, ChunkWriter, sse
from enginesmith.serving.text_stream import TextStream

log = logging.getLogger("enginesmith.serve")

MAX_BODY_BYTES = 4 << 20          # a request body (JSON); prompts are bounded by the engine's context anyway
COMPLETION_MAX_TOKENS = 16        # /v1/completions without max_tokens (OpenAI's default)
DRAIN_RETRY_AFTER_S = 5
PROMPT_BYTES_PER_TOKEN = 16       # the default byte bound of a prompt: this many bytes per position of the engine
MIN_PROMPT_BYTES = 32 << 10       # ... and at least this many


class GenerationFailed(Exception):
    """The loop ended the request with an error (the engine failed, or the server stopped)."""


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class EventRelay:
    """Hands the loop thread's events to the event loop: one wake-up per batch, not one per token.

    The loop thread publishes a step's events (one token for each of up to max-batch requests) in a
    burst; the first of a burst schedules `_deliver` on the event loop, the rest only join the list."""

    def __init__(self):
        self._event_loop = asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._batch: list[tuple[Callable[[tuple], None], tuple]] = []

    def post(self, receive: Callable[[tuple], None], event: tuple) -> None:
        """Called on the loop thread; `receive(event)` runs on the event loop."""
        with self._lock:
            self._batch.append((receive, event))
            if len(self._batch) > 1:
                return  # a delivery is already scheduled
        try:
            self._event_loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass

    def _deliver(self) -> None:
        with self._lock:
            batch, self._batch = self._batch, []
        for receive, event in batch:
            receive(event)


class Generation:
    """One submitted request as the event loop sees it: its events, its text, its token count."""

    def __init__(self, loop: BatcherLoop, text: TextStream, relay: EventRelay):
        self.loop = loop
        self.text = text
        self.relay = relay
        self._events: list[tuple] = []               # arrived, not yet taken (cheaper per token than an asyncio.Queue)
        self._arrived: asyncio.Future | None = None  # what deltas() awaits while there are none
        self.request_id: str | None = None
        self.tokens = 0
        self.ended = False

    def sink(self, event: tuple) -> None:
        """Called on the loop thread."""
        self.relay.post(self._receive, event)

    def _receive(self, event: tuple) -> None:
        self._events.append(event)
        if self._arrived is not None and not self._arrived.done():
            self._arrived.set_result(None)

    async def _take(self) -> list[tuple]:
        """Every event that has arrived, waiting for one if there is none."""
        while not self._events:
            self._arrived = asyncio.get_running_loop().create_future()
            await self._arrived
        events, self._events = self._events, []
        return events

    async def deltas(self) -> AsyncIterator[tuple[str, str | None]]:
        """(text, None) per new piece of text, then (the last text, finish reason "stop" | "length").
        Tokens that arrived together (the client or the event loop fell behind) come as one piece."""
        while True:
            events = await self._take()
            pieces = []
            for event in events:
                if event[0] == "token":
                    self.tokens += 1
                    pieces.append(self.text.push(event[1]))
                    if self.text.stopped:  # a stop token, or a stop string the text shows first: it ends here
                        self.close(stopped=True)
                        yield "".join(pieces), "stop"
                        return
                elif event[0] == "done":
                    self.ended = True
                    pieces.append(self.text.finish())
                    yield "".join(pieces), "length" if event[1] == "length" else "stop"
                    return
                else:
                    self.ended = True
                    if any(pieces):
                        yield "".join(pieces), None
                    raise GenerationFailed(event[1])
            if any(pieces):
                yield "".join(pieces), None

    async def collect(self) -> tuple[str, str]:
        parts, finish = [], "stop"
        async for delta, finish in self.deltas():
            parts.append(delta)
        return "".join(parts), finish

    def close(self, stopped: bool = False) -> None:
        """End the request if it still runs (the client went away, or `stopped`: a stop string was seen)."""
        if not self.ended and self.request_id is not None:
            self.loop.cancel(self.request_id, stopped=stopped)
        self.ended = True


class EventStream(StreamingResponse):
    """Server-sent events; `on_close()` runs however the stream ends: done, client gone, server stopping.

    The disconnect is watched here, whatever ASGI spec version the server speaks, so a client that
    leaves while its request still waits (no chunk to fail on yet) is seen at once."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]):
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send_until_disconnect(receive, lambda: self.stream_response(send))
        finally:
            self.on_close()
            await self.body_iterator.aclose()


async def _unless_disconnected(receive, work):
    """The result of coroutine `work`, or ClientGone when the client disconnects first."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    raise ClientGone()


class OpenAIServer:
    """The routes' shared state: the loop, the tokenizer, the limits, the metrics, draining."""

    def __init__(self, loaded, loop: BatcherLoop, model_name: str, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES, completion_max_tokens: int = COMPLETION_MAX_TOKENS,
                 metrics_interval_s: float = 1.0, max_prompt_bytes: int | None = None, front_end: int | None = None):
        self.loaded, self.loop, self.model_name = loaded, loop, model_name
        self.tokenizer = loaded.tokenizer
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.completion_max_tokens = completion_max_tokens
        self.metrics_interval_s = metrics_interval_s
        self.max_prompt_bytes = max_prompt_bytes or default_prompt_bytes(self._positions())
        self.stop_ids = stop_token_ids(loaded.tokenizer, loaded.manifest)
        self.vocab = loaded.manifest.model.vocab or len(loaded.tokenizer)
        self.metrics = ServerMetrics(loop, front_end=front_end)  # front_end: k of serve --front-ends N > 1
        self.draining = False
        self.created = int(time.time())
        self.relay: EventRelay | None = None

    def begin_drain(self) -> None:
        """Refuse new requests (503) and report /health 503; those in flight go on."""
        self.draining = True

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        async def sample() -> None:  # keeps the loop's latency observations from piling up
            while True:
                await asyncio.sleep(self.metrics_interval_s)
                self.metrics.sample()

        task = asyncio.ensure_future(sample())
        try:
            yield
        finally:
            task.cancel()

    # ------------------------------------------------------------------ routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        self._check_model(request.path_params["model"])
        return JSONResponse(self._model_card())

    async def health(self, request: Request) -> Response:
        if self.draining or not self.loop.alive:
            status = "draining" if self.draining else "stopped"
            return JSONResponse({"status": status}, 503, headers={"Retry-After": str(DRAIN_RETRY_AFTER_S)})
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, chat: bool) -> Response:
        self._authorize(request)
        try:
            body = parse_json(await self._body(request))
            req = parse_chat(body) if chat else parse_completion(body, self.vocab)
            self._check_model(req.model)
            if self.draining:
                raise Draining()
            self._check_prompt_bytes(req)  # before any tokenizer work: a huge prompt is refused for free
            ids = await run_in_threadpool(self._encode, req)
            stop_ids = () if req.ignore_eos else self.stop_ids
            if self.relay is None:  # made on the event loop's thread, which it wakes
                self.relay = EventRelay()
            gen = Generation(self.loop, TextStream(self.tokenizer, stop_ids, req.stop), self.relay)
            handle = self.loop.submit(ids, req.max_tokens or self._default_max_tokens(len(ids), chat), stop_ids,
                                      req.stop, req.sampling, sink=gen.sink)
            gen.request_id = handle.request_id
        except ClientDisconnect:  # gone while sending its body
            return Response(status_code=499)
        except ApiError:
            self.metrics.rejected("invalid")
            raise
        except Overloaded as exc:
            self.metrics.rejected("overloaded")
            raise ApiError(429, str(exc), None, "overloaded", retry_after=exc.retry_after) from None
        except Draining:
            self.metrics.rejected("draining")
            raise ApiError(503, "the server is shutting down and takes no new requests", None, "draining",
                           retry_after=DRAIN_RETRY_AFTER_S) from None
        except EngineError as exc:  # the engine's own files (a chat template over its limits): not the client's fault
            raise ApiError(500, f"the model could not serve this request: {exc.what}", None, "engine_error") from None
        except UserError as exc:  # a prompt too long for the engine, not UTF-8, refused by the chat template
            self.metrics.rejected("invalid")
            raise ApiError(400, str(exc), None, "invalid_request") from None

        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            return EventStream(self._chunks(gen, req, rid, chat, len(ids)), on_close=gen.close)
        try:
            text, finish = await _unless_disconnected(request.receive, gen.collect())
        except ClientGone:
            return Response(status_code=499)  # nobody is left to read it
        except GenerationFailed as exc:
            raise ApiError(500, str(exc), None, "engine_error") from None
        finally:
            gen.close()
        use = usage(len(ids), gen.tokens)
        make = chat_body if chat else completion_body
        return JSONResponse(make(rid, int(time.time()), self.model_name, text, finish, use))

    async def _chunks(self, gen: Generation, req: GenerationRequest, rid: str, chat: bool,
                      prompt_tokens: int) -> AsyncIterator[bytes]:
        out = ChunkWriter(rid, int(time.time()), self.model_name, chat)
        try:
            if chat:
                yield out.role()
            async for delta, finish in gen.deltas():
                if delta:
                    yield out.text(delta)
                if finish is not None:
                    yield out.finish(finish)
            if req.include_usage:
                yield out.usage(usage(prompt_tokens, gen.tokens))
        except GenerationFailed as exc:
            yield sse(error_body(str(exc), "server_error", None, "engine_error"))
        yield DONE

    # ------------------------------------------------------------------ pieces

    def _authorize(self, request: Request) -> None:
        check_api_key(request, self.api_key)

    def _check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ApiError(404, f"the model {name[:100]!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    async def _body(self, request: Request) -> bytes:
        return await read_body(request, self.max_body_bytes)

    def _check_prompt_bytes(self, req: GenerationRequest) -> None:
        limit = self.max_prompt_bytes
        if req.messages is not None:
            size, param = prompt_bytes(req.messages, limit), "messages"
        elif isinstance(req.prompt, str):
            size, param = prompt_bytes(req.prompt, limit), "prompt"
        else:
            return  # token ids: their count is checked against the engine's positions
        if size > limit:
            raise ApiError(400, f"the prompt is over {limit} bytes of text, the most this server takes "
                                "(serve --max-prompt-bytes); shorten it", param, "context_length_exceeded")

    def _positions(self) -> int:
        """Positions a request may reach: the engine's, else what the page pool holds."""
        model = self.loop.batcher.model
        return model.max_positions or self.loaded.max_positions or (model.num_pages - 1) * model.page_size

    def _encode(self, req: GenerationRequest) -> list[int]:
        """Token ids of the prompt (a worker thread: a chat template or a long text takes a while).
        Special-token spellings in client text stay text (runtime.text.chat)."""
        if req.messages is not None:
            if not self.tokenizer.chat_template:
                raise ApiError(400, "this model has no chat template; use /v1/completions", "messages", "unsupported")
            return encode_chat(self.tokenizer, req.messages)
        if isinstance(req.prompt, str):
            return encode_prompt(self.tokenizer, req.prompt, raw=True)
        return list(req.prompt)

    def _default_max_tokens(self, prompt_tokens: int, chat: bool) -> int:
        """The room left for the answer (the engine's positions, less a step's padding, and the page
        pool), at most 16 for completions: a request the engine cannot hold is refused by submit."""
        batcher = self.loop.batcher
        model = batcher.model
        room = (model.num_pages - 1) * model.page_size - prompt_tokens
        limit = model.max_positions or self.loaded.max_positions
        if limit:
            room = min(room, limit - prompt_tokens - (batcher.chunk - 1))
        cap = MAX_NEW_TOKENS if chat else self.completion_max_tokens
        return max(1, min(room, cap))

    def _model_card(self) -> dict:
        model = self.loop.batcher.model
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "enginesmith",
                "max_model_len": model.max_positions or self.loaded.max_positions}


def default_prompt_bytes(positions: int) -> int:
    """The default byte bound of a prompt for an engine of `positions` positions."""
    return max(MIN_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * positions)


def prompt_bytes(value, limit: int) -> int:
    """UTF-8 bytes of the text in `value` (a string, or messages: lists and dicts of strings), counted
    only until it passes `limit` (then some number above it): the cost is bounded by the limit."""
    total, stack = 0, [value]
    while stack and total <= limit:
        item = stack.pop()
        if isinstance(item, str):
            # a character is 1-4 bytes: a string over the limit in characters is over it in bytes
            total += len(item) if len(item) > limit else len(item.encode("utf-8", "surrogatepass"))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


async def _internal_error(request: Request, exc: Exception) -> Response:
    log.error("internal error on %s %s: %s: %s", request.method, request.url.path[:200], type(exc).__name__, exc)
    return JSONResponse(error_body("internal server error (the server's log has the details)", "server_error"), 500)


def make_app(loaded, loop: BatcherLoop, model_name: str, api_key: str | None = None, **options) -> Starlette:
    """The ASGI app serving `loaded` (a LoadedEngine) through `loop` under `model_name`; `options` are
    OpenAIServer's (max_body_bytes, completion_max_tokens, metrics_interval_s, max_prompt_bytes, front_end).
    The OpenAIServer is app.state.api (its begin_drain() is what a shutdown calls first)."""
    api = OpenAIServer(loaded, loop, model_name, api_key, **options)
    routes = [Route("/v1/completions", api.completions, methods=["POST"]),
              Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
              Route("/v1/models", api.models, methods=["GET"]),
              Route("/v1/models/{model:path}", api.model, methods=["GET"]),
              Route("/health", api.health, methods=["GET"]),
              Route("/metrics", api.metrics_text, methods=["GET"])]
    app = Starlette(routes=routes, lifespan=api.lifespan,
                    exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: _internal_error})
    app.state.api = api
    return app
