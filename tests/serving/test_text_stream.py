"""enginesmith/serving/text_stream.TextStream against runtime.decoding.generate.stream (the oracle): fed a
request's token ids one by one, it gives the same text deltas, the same cut before a stop string, the same end at a
stop token, and releases the held text at the end."""

from __future__ import annotations

import pytest

from enginesmith.runtime.text.chat import encode_prompt
from enginesmith.runtime.decoding.generate import GenerationConfig, stream
from enginesmith.runtime.load import open_engine
from enginesmith.serving.text_stream import TextStream, first_stop


@pytest.fixture(scope="module")
def loaded(tiny_engine):
    return open_engine(tiny_engine("llama"), device="cpu", verify_hashes=False)


def oracle(loaded, prompt: str, n: int, stop_strings=(), stop_ids=()):
    """(per-step deltas, Completion) of generate.stream for one prompt."""
    config = GenerationConfig(max_new_tokens=n, stop_strings=tuple(stop_strings), stop_token_ids=tuple(stop_ids),
                              max_positions=loaded.max_positions)
    gen = stream(loaded.engine, loaded.tokenizer, [encode_prompt(loaded.tokenizer, prompt)], config, loaded.pad_id)
    deltas = []
    while True:
        try:
            deltas.append(next(gen)[0])
        except StopIteration as end:
            return deltas, end.value[0]


def same(replayed: list[str], deltas: list[str]) -> bool:
    """Equal per token; stream() goes on yielding "" for a row a stop string ended (the batch runs on)."""
    return replayed == deltas[:len(replayed)] and not any(deltas[len(replayed):])


def replay(loaded, token_ids, stop_strings=(), stop_ids=()) -> list[str]:
    text = TextStream(loaded.tokenizer, stop_ids, stop_strings)
    deltas = []
    for token in token_ids:
        deltas.append(text.push(token))
        if text.stopped:
            break
    tail = text.finish()
    return deltas + ([tail] if tail else [])


@pytest.mark.parametrize("prompt", ["Tell me a story.", "What is 2 + 2?"])
def test_deltas_equal_generate_stream(loaded, prompt):
    deltas, done = oracle(loaded, prompt, 40)
    assert same(replay(loaded, done.token_ids), deltas)


def test_a_stop_string_cuts_the_text_as_generate_does(loaded):
    _, whole = oracle(loaded, "Tell me a story.", 40)
    for stop in (whole.text[10:12], whole.text[25:28], [whole.text[30:31], whole.text[12:14]]):
        stops = stop if isinstance(stop, list) else [stop]
        deltas, done = oracle(loaded, "Tell me a story.", 40, stops)
        assert done.finish_reason == "stop"
        assert same(replay(loaded, done.token_ids, stops), deltas)
        assert "".join(deltas) == done.text == whole.text[:first_stop(whole.text, stops)]


def test_a_stop_token_adds_no_text(loaded):
    _, whole = oracle(loaded, "Tell me a story.", 40)
    stop_id = whole.token_ids[7]
    deltas, done = oracle(loaded, "Tell me a story.", 40, stop_ids=[stop_id])
    assert done.token_ids[-1] == stop_id and done.finish_reason == "stop"
    assert same(replay(loaded, done.token_ids, stop_ids=[stop_id]), deltas)


def test_finish_releases_held_text_and_cuts_a_stop_the_scheduler_saw(loaded):
    text = TextStream(loaded.tokenizer, stop_strings=["zzzz"])
    ids = loaded.tokenizer.encode("hello world", add_special_tokens=False)
    got = "".join(text.push(t) for t in ids)
    assert got == "hello world"[:len(got)] and len(got) <= len("hello world") - 3  # 3 characters held
    assert got + text.finish() == "hello world" and text.stopped
    text = TextStream(loaded.tokenizer, stop_strings=["wor", "zzzz"])
    got = "".join(text.push(t) for t in loaded.tokenizer.encode("hello", add_special_tokens=False))
    text.held += " world"  # the scheduler ended it on a stop string the text had not shown yet
    assert got + text.finish() == "hello "
