"""A small real HTTP server that streams like an OpenAI-compatible server and like Triton's generate
endpoint, with known timing, for testing `enginesmith bench serve` (enginesmith/measure/http_load.py) against.

Run: python tests/helpers/sse_server.py --port P [--api-key KEY] [--model NAME]   (Starlette on uvicorn, 127.0.0.1)

Every streamed request gets ceil(max_tokens / k) events of k tokens each ("t0 t1 ..."), the first
after `first_delay` seconds and the next ones `delay` apart; per-request knobs come in the body
(the client's --extra-body): first_delay (default 0.05), delay (0.005), tokens_per_chunk k (1),
usage (true: honour stream_options.include_usage). The prompt text picks a failure:
    FAIL        503 with an OpenAI-style JSON error          STALL      one event, then 60 s of silence
    BREAK       one event, then the connection is cut        BADJSON    an event whose data is not JSON
    ERROREVENT  an event {"error": {...}} after one token     NODONE     (openai) no `data: [DONE]` at the end
    ENDLESS     one line that never ends (64 KiB pieces, 64 MiB at most, then 60 s of silence)
POST /models-body {"body": text}: what GET /v1/models answers from then on (a malformed list); /reset restores it.
GET /stats: requests seen, in flight now and at most, arrival times (time.monotonic), the last 64
bodies; POST /reset clears them (streams still open then no longer count). With --api-key, every request without `Bearer KEY` gets 401.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

STATE = {"requests": 0, "in_flight": 0, "max_in_flight": 0, "arrivals": [], "bodies": [], "epoch": 0}
CONFIG = {"api_key": None, "model": "fake-model", "models_body": None}


def _authorized(request: Request) -> bool:
    return CONFIG["api_key"] is None or request.headers.get("authorization") == f"Bearer {CONFIG['api_key']}"


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "bad key", "type": "invalid_request_error"}}, status_code=401)


async def models(request: Request):
    if not _authorized(request):
        return _unauthorized()
    if CONFIG["models_body"] is not None:
        return Response(CONFIG["models_body"], media_type="application/json")
    return JSONResponse({"object": "list", "data": [{"id": CONFIG["model"], "object": "model"}]})


async def models_body(request: Request):
    CONFIG["models_body"] = (await request.json())["body"]
    return JSONResponse({})


async def ready(request: Request):
    return JSONResponse({})


async def repository_index(request: Request):
    return JSONResponse([{"name": CONFIG["model"], "version": "1", "state": "READY"}])


async def stats(request: Request):
    return JSONResponse(STATE)


async def reset(request: Request):
    # a stream of the last test still open (a stalled one) must not count against the next test
    STATE.update(requests=0, in_flight=0, max_in_flight=0, arrivals=[], bodies=[], epoch=STATE["epoch"] + 1)
    CONFIG["models_body"] = None
    return JSONResponse({})


def _sse(obj) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


async def _stream(api: str, body: dict, prompt: str, epoch: int):
    n = int(body.get("max_tokens", 16))
    k = int(body.get("tokens_per_chunk", 1))
    first_delay, delay = float(body.get("first_delay", 0.05)), float(body.get("delay", 0.005))
    try:
        if prompt == "ENDLESS":
            yield "data: "
            for _ in range(1024):
                yield "x" * 65536
                await asyncio.sleep(0)
            await asyncio.sleep(60)
        made = 0
        for i in range(math.ceil(n / k)):
            await asyncio.sleep(first_delay if i == 0 else delay)
            count = min(k, n - made)
            text = "".join(f" t{made + j}" for j in range(count))
            made += count
            if api == "openai":
                yield _sse({"object": "text_completion", "choices": [{"index": 0, "text": text}]})
            else:
                yield _sse({"model_name": CONFIG["model"], "text_output": text})
            if prompt == "STALL":
                await asyncio.sleep(60)
            if prompt == "BREAK":
                raise ConnectionAbortedError("cut on purpose")
            if prompt == "BADJSON":
                yield _sse("{not json")
            if prompt == "ERROREVENT":
                yield _sse({"error": {"message": "the model failed", "type": "server_error"}})
                return
        if api == "openai":
            if body.get("usage", True) and (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({"object": "text_completion", "choices": [],
                            "usage": {"prompt_tokens": 1, "completion_tokens": made, "total_tokens": made + 1}})
            if prompt != "NODONE":
                yield _sse("[DONE]")
        else:
            yield _sse({"model_name": CONFIG["model"], "text_output": "", "token_ids": list(range(made)),
                        "finish_reason": "length"})
    finally:
        if STATE["epoch"] == epoch:
            STATE["in_flight"] -= 1


async def _generate(request: Request, api: str):
    if not _authorized(request):
        return _unauthorized()
    body = await request.json()
    STATE["requests"] += 1
    STATE["arrivals"].append(time.monotonic())
    STATE["bodies"] = (STATE["bodies"] + [body])[-64:]
    prompt = body.get("prompt" if api == "openai" else "text_input", "")
    if prompt == "FAIL":
        return JSONResponse({"error": {"message": "overloaded", "type": "server_error"}}, status_code=503,
                            headers={"Retry-After": "1"})
    STATE["in_flight"] += 1
    STATE["max_in_flight"] = max(STATE["max_in_flight"], STATE["in_flight"])
    return StreamingResponse(_stream(api, body, prompt, STATE["epoch"]), media_type="text/event-stream")


async def completions(request: Request):
    return await _generate(request, "openai")


async def generate_stream(request: Request):
    return await _generate(request, "triton")


app = Starlette(routes=[
    Route("/v1/models", models), Route("/v1/completions", completions, methods=["POST"]),
    Route("/v2/health/ready", ready), Route("/v2/repository/index", repository_index, methods=["POST"]),
    Route("/v2/models/{model}/generate_stream", generate_stream, methods=["POST"]),
    Route("/stats", stats), Route("/reset", reset, methods=["POST"]),
    Route("/models-body", models_body, methods=["POST"]),
])


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--model", default="fake-model")
    a = ap.parse_args()
    CONFIG.update(api_key=a.api_key, model=a.model)
    uvicorn.run(app, host="127.0.0.1", port=a.port, log_level="warning")
