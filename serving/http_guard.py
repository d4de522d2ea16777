"""The two checks every HTTP front door of enginesmith makes before it looks at a request: the API key
and the body's size (`enginesmith serve`'s server, serving/openai_api.py, and its replicas' front door,
serving/front_door.py). Both raise ApiError, which the apps turn into OpenAI-style JSON errors.

    check_api_key(request, key)   401 unless `Authorization: Bearer <key>` (constant-time compare); key None: open
    read_body(request, limit)     the body, 413 past `limit` bytes (declared or streamed)
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from enginesmith.serving.openai_protocol import ApiError


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
