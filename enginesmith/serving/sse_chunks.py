"""The server-sent events of one streamed OpenAI answer, as bytes: per request, the JSON of a text chunk
is made once around a placeholder and split there; each new piece of text then costs one json.dumps of
the text alone (a per-token cost of `enginesmith serve`, issue 19).

    chunk = openai_protocol.completion_chunk(rid, created, model, PLACEHOLDER, None)  (chat: chat_chunk)
    b"data: " + json.dumps(chunk) ──split at the placeholder's JSON──▶ head, tail
    text(piece) = head + json.dumps(piece) + tail          == sse(completion_chunk(..., piece, None))

Every other event (the role chunk, the finish chunk, usage, an error) is rare: one json.dumps of the dict.
The bytes are those of json.dumps(obj, ensure_ascii=False) (tested: equal to the dict's own JSON).
"""

from __future__ import annotations

import json

from enginesmith.serving.openai_protocol import chat_chunk, completion_chunk, usage_chunk

PLACEHOLDER = "\ue000enginesmith text\ue001"  # private-use characters: in no id or model name we make
DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One event carrying `obj` as JSON."""
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


class ChunkWriter:
    """The SSE events of one streamed completion (chat or not): `text(piece)` per new piece of text."""

    def __init__(self, rid: str, created: int, model: str, chat: bool):
        self.rid, self.created, self.model, self.chat = rid, created, model, chat
        parts = self._chunk(PLACEHOLDER, None).split(json.dumps(PLACEHOLDER, ensure_ascii=False).encode())
        self._template = (parts[0], parts[1]) if len(parts) == 2 else None  # else (a model name holding it): dumps

    def text(self, piece: str) -> bytes:
        if self._template is None:
            return self._chunk(piece, None)
        head, tail = self._template
        return head + json.dumps(piece, ensure_ascii=False).encode() + tail

    def role(self) -> bytes:
        """Chat's first event: the assistant's role, no text yet."""
        return sse(chat_chunk(self.rid, self.created, self.model, {"role": "assistant", "content": ""}, None))

    def finish(self, reason: str) -> bytes:
        return self._chunk(None, reason)

    def usage(self, use: dict) -> bytes:
        return sse(usage_chunk(self.rid, self.created, self.model, self.chat, use))

    def _chunk(self, text: str | None, finish: str | None) -> bytes:
        if self.chat:
            return sse(chat_chunk(self.rid, self.created, self.model, {} if text is None else {"content": text},
                                  finish))
        return sse(completion_chunk(self.rid, self.created, self.model, text or "", finish))
