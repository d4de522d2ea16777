"""One request's text, token by token, for a streaming front door fed by the scheduler loop.

The loop (serving/loop.py) hands out token ids; a client wants text. `TextStream` turns the ids of
one request into text deltas with the rules of runtime.decoding.generate.stream, so a request answers the
same text whichever path served it:

    token ──▶ stop token?  ── yes ─▶ the held text, then stopped (the stop token adds no text)
                │ no
                ▼
    IncrementalDetokenizer.push (never half a UTF-8 character)
                │
                ▼
    held + new text: a stop string in it? ── yes ─▶ the text before it, then stopped
                │ no
                ▼
    all but the last (longest stop string - 1) characters, which are held: they may begin a stop string

`finish()` gives back what is held once the request ended for another reason (length, or a stop the
scheduler saw first), cut before a stop string if one is there.
"""

from __future__ import annotations

from typing import Sequence

from enginesmith.runtime.decoding.generate import IncrementalDetokenizer


def first_stop(text: str, stop_strings: Sequence[str], start: int = 0) -> int | None:
    """Index in `text` where the earliest stop string begins, searching from near `start`."""
    hits = [i for s in stop_strings if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
    return min(hits) if hits else None


class TextStream:
    """Text deltas of one request's tokens; `text` is what was emitted, `stopped` once it ended."""

    def __init__(self, tokenizer, stop_token_ids: Sequence[int] = (), stop_strings: Sequence[str] = ()) -> None:
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.text = ""
        self.held = ""
        self.stopped = False

    def push(self, token: int) -> str:
        """The text `token` adds ("" while nothing new is printable, or after the stream stopped)."""
        if self.stopped:
            return ""
        if int(token) in self.stop_token_ids:
            self.stopped = True
            return self._emit(self.held)
        if not self.stop_strings:  # nothing is held: the new text is the delta
            delta = self.detok.push(token)
            self.text += delta
            return delta
        pending = self.held + self.detok.push(token)
        # Only the emitted text's last (longest stop string - 1) characters can begin a stop string.
        base = max(0, len(self.text) - self.hold)
        cut = first_stop(self.text[base:] + pending, self.stop_strings, len(self.text) - base)
        if cut is not None:
            self.stopped = True
            return self._emit(pending[:max(0, base + cut - len(self.text))])
        keep = max(len(pending) - self.hold, 0) if self.hold else len(pending)
        delta, self.held = pending[:keep], pending[keep:]
        self.text += delta
        return delta

    def finish(self) -> str:
        """The held text, once the request has ended (cut before a stop string if it holds one)."""
        if self.stopped:
            return ""
        self.stopped = True
        cut = first_stop(self.text + self.held, self.stop_strings, len(self.text))
        return self._emit(self.held if cut is None else (self.text + self.held)[len(self.text):cut])

    def _emit(self, delta: str) -> str:
        self.held = ""
        self.text += delta
        return delta
