"""What every HTTP front door of enginesmith shares (`enginesmith serve`'s server, serving/openai_api.py,
and its replicas' front door, serving/front_door.py): the two checks made before a request is read, and
the handlers that turn refusals into OpenAI-style JSON errors.

    check_api_key(request, key)      401 unless `Authorization: Bearer <key>` (constant-time compare); key None: open
    read_body(request, limit)        the body, 413 past `limit` bytes (declared or streamed)
    api_error(request, exc)          an ApiError as its JSON body (Retry-After, WWW-Authenticate)
    http_error(request, exc)         Starlette's own refusals (no such route, a wrong method), same shape
    send_until_disconnect(receive, body)   run a response's sending until it ends or the client leaves
"""

from __future__ import annotations

import hmac
from typing import Awaitable, Callable

import anyio
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from enginesmith.serving.openai_protocol import ApiError, error_body


def check_api_key(request: Request, key: bytes | None) -> None:
    if key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
        raise ApiError(401, "missing or wrong API key (send the header Authorization: Bearer <key>)", None,
                       "invalid_api_key")


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body is {declared} bytes; at most {limit} are accepted")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the {limit} bytes accepted")
        chunks.append(chunk)
    return b"".join(chunks)


async def api_error(request: Request, exc: ApiError) -> Response:
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    if exc.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(exc.body(), exc.status, headers=headers)


async def http_error(request: Request, exc: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    message = f"{request.method} {request.url.path[:200]}: {exc.detail}"
    return JSONResponse(error_body(message, ApiError.TYPES.get(exc.status_code, "invalid_request_error"), None, code),
                        exc.status_code, headers=exc.headers)


async def disconnected(receive) -> None:
    """Returns once the client has disconnected (ASGI http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def send_until_disconnect(receive, body: Callable[[], Awaitable[None]]) -> None:
    """Await body() (which sends a response) until it ends or the client disconnects, whichever comes
    first; the other is cancelled. The disconnect is watched from the start, whatever ASGI spec version
    the server speaks, so a client that leaves before the first byte is seen at once; an OSError from a
    client gone mid-send ends the body quietly."""
    async def run() -> None:
        try:
            await body()
        except OSError:  # the client went away mid-send
            pass
        group.cancel_scope.cancel()

    async with anyio.create_task_group() as group:
        group.start_soon(run)
        await disconnected(receive)
        group.cancel_scope.cancel()
