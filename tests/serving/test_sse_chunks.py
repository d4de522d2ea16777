"""enginesmith/serving/sse_chunks.py: the templated SSE events are byte for byte the events made from the dicts
(openai_protocol's chunk builders, json.dumps with ensure_ascii=False), whatever the text holds."""

from __future__ import annotations

import json

import pytest

from enginesmith.serving.openai_protocol import chat_chunk, completion_chunk, usage, usage_chunk
from enginesmith.serving.sse_chunks import PLACEHOLDER, ChunkWriter, sse

PIECES = ["Hello", " world", "", "quote \" back\\slash", "new\nline\ttab", "été 日本 \U0001f600", "\x00\x1f\u2028",
          PLACEHOLDER]


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", ["tiny", "a \"quoted\" / model", PLACEHOLDER])
def test_text_chunks_equal_the_dicts_json(chat, model):
    out = ChunkWriter("cmpl-1", 1700000000, model, chat)
    assert (out._template is None) == (model == PLACEHOLDER)  # a model name holding the placeholder: dumps
    for piece in PIECES:
        want = chat_chunk("cmpl-1", 1700000000, model, {"content": piece}, None) if chat else \
            completion_chunk("cmpl-1", 1700000000, model, piece, None)
        got = out.text(piece)
        assert got == sse(want) and got.startswith(b"data: ") and got.endswith(b"\n\n")
        assert json.loads(got[6:]) == want


def test_the_other_events():
    out = ChunkWriter("chatcmpl-2", 5, "m", chat=True)
    assert out.role() == sse(chat_chunk("chatcmpl-2", 5, "m", {"role": "assistant", "content": ""}, None))
    assert out.finish("length") == sse(chat_chunk("chatcmpl-2", 5, "m", {}, "length"))
    assert out.usage(usage(3, 4)) == sse(usage_chunk("chatcmpl-2", 5, "m", True, usage(3, 4)))
    out = ChunkWriter("cmpl-3", 5, "m", chat=False)
    assert out.finish("stop") == sse(completion_chunk("cmpl-3", 5, "m", "", "stop"))
