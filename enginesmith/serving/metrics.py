"""Prometheus metrics of one BatcherLoop, in the text exposition format (version 0.0.4), by hand.

    the loop thread ── stats(), take_observations() ──▶ ServerMetrics.sample() (every second, and at
                                                        each scrape) ──▶ render() ──▶ GET /metrics

Names (all prefixed enginesmith_):

    requests_running                 gauge      requests in the running batch
    requests_waiting                 gauge      requests queued, not yet running
    kv_pages_used / kv_pages_total   gauge      KV cache pages held by requests / in the pool
    prompt_tokens_total              counter    prompt tokens of the requests taken
    generation_tokens_total          counter    tokens generated
    requests_total{outcome}          counter    finished | cancelled (the client went away)
    requests_rejected_total{reason}  counter    overloaded (429) | draining (503) | invalid (400, 404, 413)
    generation_tokens_per_second     gauge      tokens generated over the last WINDOW_S seconds
    time_to_first_token_seconds      histogram  from the request's submission to the loop (its prompt
                                                tokenized) to its first token
    inter_token_latency_seconds      histogram  between two tokens of one request

The loop keeps its TTFT/ITL observations until taken; sampling takes them every second, so they
never pile up whether or not anyone scrapes.

Several front ends over one engine core (`serve --front-ends N`, serving/front_ends.py): a scrape reaches
one of them. Every figure above but one is the core's, the same on each front end (requests_waiting adds
that front end's requests sent and not yet taken; the histograms hold what the core observed since that
front end connected), so no scrape double-counts the engine. requests_rejected_total is counted by each
front end's HTTP layer and carries a front_end="k" label there: each front end's series is its own, and
their sum is the server's.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque

PREFIX = "enginesmith_"
WINDOW_S = 10.0
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
REJECT_REASONS = ("overloaded", "draining", "invalid")


class Histogram:
    """Cumulative buckets (upper bounds `le`, then +Inf), sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        assert list(buckets) == sorted(buckets), "bucket bounds must increase"
        self.bounds = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, values) -> None:
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.sum += v
            self.count += 1

    def lines(self, name: str, help_text: str) -> list[str]:
        out = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip([*map(_number, self.bounds), "+Inf"], self.counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return out + [f"{name}_sum {_number(self.sum)}", f"{name}_count {self.count}"]


class ServerMetrics:
    """The metrics of one loop; `rejected(reason)` counts requests refused before they reached it."""

    def __init__(self, loop, window_s: float = WINDOW_S, front_end: int | None = None):
        self.loop = loop
        self.label = "" if front_end is None else f'front_end="{front_end}",'
        self.window_s = window_s
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.rejections = dict.fromkeys(REJECT_REASONS, 0)
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, tokens generated so far)
        self._lock = threading.Lock()

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejections[reason] += 1

    def sample(self):
        """Take the loop's new observations into the histograms and note the token count; the stats."""
        ttft, itl = self.loop.take_observations()
        stats = self.loop.stats()
        now = time.monotonic()
        with self._lock:
            self.ttft.observe(ttft)
            self.itl.observe(itl)
            self._samples.append((now, stats.generated_tokens))
            while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
                self._samples.popleft()  # keep one sample at least window_s old
        return stats

    def tokens_per_second(self) -> float:
        with self._lock:
            return self._rate()

    def _rate(self) -> float:  # under the lock
        if len(self._samples) < 2:
            return 0.0
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else 0.0

    def render(self) -> str:
        s = self.sample()
        p = PREFIX
        lines: list[str] = []

        def one(name: str, kind: str, help_text: str, value) -> None:
            lines.extend([f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}", f"{p}{name} {_number(value)}"])

        one("requests_running", "gauge", "Requests in the running batch.", s.running)
        one("requests_waiting", "gauge", "Requests queued, not yet running.", s.waiting)
        one("kv_pages_used", "gauge", "KV cache pages held by requests.", s.pages_used)
        one("kv_pages_total", "gauge", "KV cache pages in the pool.", s.pages_total)
        one("prompt_tokens_total", "counter", "Prompt tokens of the requests taken.", s.prompt_tokens)
        one("generation_tokens_total", "counter", "Tokens generated.", s.generated_tokens)
        lines += [f"# HELP {p}requests_total Requests ended, by outcome.", f"# TYPE {p}requests_total counter",
                  f'{p}requests_total{{outcome="finished"}} {s.requests_finished}',
                  f'{p}requests_total{{outcome="cancelled"}} {s.requests_cancelled}',
                  f"# HELP {p}requests_rejected_total Requests refused before generation, by reason.",
                  f"# TYPE {p}requests_rejected_total counter"]
        with self._lock:
            lines += [f'{p}requests_rejected_total{{{self.label}reason="{r}"}} {n}'
                      for r, n in self.rejections.items()]
            one("generation_tokens_per_second", "gauge",
                f"Tokens generated per second over the last {self.window_s:g} s.", self._rate())
            lines += self.ttft.lines(f"{p}time_to_first_token_seconds",
                                     "Time from a request's submission to the scheduler to its first token.")
            lines += self.itl.lines(f"{p}inter_token_latency_seconds", "Time between two tokens of a request.")
        return "\n".join(lines) + "\n"


def _number(value) -> str:
    """A sample value as Prometheus writes it (integers without a fraction)."""
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return repr(float(value))
