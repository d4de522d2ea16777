"""KV pages per request at 8k context, before and after sliding-window layers free their pages
(issue 29 goal 4). A count on the CPU, not a GPU measurement: the runtime's own scheduler and block
manager (runtime/decoding/batching.py, runtime/kv/block_manager.py) run one request to the context with a stub
model (the page count depends only on the positions scheduled, not on the logits), at the paged
engine's page size (16) and chunk (the paged op's max_query_len, plugins/limits.json).

    python benchmarks/kv_window/pages.py [--context 8192] [--prompt 8064] [--json]

Rows: Mistral 7B v0.1 (every layer a window of 4096: freed), Gemma 2 (window 4096 on every other
layer) and Gemma 3 (1024 on 5 layers of 6): one block table serves every layer, and a global layer
needs every page, so nothing is freed. Their "split tables" column is what a second block table for
the windowed layers would hold (the same manager with the window, weighted by the layers it serves):
a projection, not built (the graph feeds every layer one table).
"""

from __future__ import annotations

import argparse
import json

from enginesmith.plugins.limits import limits
from enginesmith.runtime.decoding.batching import ContinuousBatcher, SchedulerConfig

PAGE = 16
MODELS = {  # name: (window, windowed layers, layers, KV heads, head size)  (their HF configs)
    "mistral-7b-v0.1": (4096, 32, 32, 8, 128),
    "gemma-2-9b": (4096, 21, 42, 8, 256),
    "gemma-3-12b": (1024, 40, 48, 8, 256),
}


class CountingModel:
    """A PagedModel that computes nothing: token 1 for every pick."""

    max_positions = None

    def __init__(self, num_pages: int, window: int | None, chunk: int):
        self.num_pages, self.page_size, self.max_chunk, self.kv_window = num_pages, PAGE, chunk, window

    def copy_pages(self, copies) -> None:
        pass

    def run(self, ids, step, picks) -> list[int]:
        return [1] * len(picks)


def pages_at_context(window: int | None, prompt: int, context: int, chunk: int) -> tuple[int, int]:
    """(pages the request holds once its context reaches `context` positions, the most it held)."""
    model = CountingModel(context // PAGE + 64, window, chunk)
    batcher = ContinuousBatcher(model, SchedulerConfig(max_batch=1, max_tokens=chunk, chunk=chunk))
    rid = batcher.add_request([2] * prompt, max_new_tokens=context - prompt + 2)  # still running at `context`
    held = most = 0
    while batcher.manager.num_tokens(rid) < context:
        batcher.step()
        held = batcher.manager.num_held(rid)
        most = max(most, held)
        batcher.manager.check_invariants()
    return held, most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=8192, help="positions the request reaches")
    parser.add_argument("--prompt", type=int, default=8064, help="prompt tokens (the rest are decode steps)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()
    chunk = int(limits()["paged_attention"]["max_query_len"])
    before, _ = pages_at_context(None, args.prompt, args.context, chunk)
    rows = {}
    for name, (window, windowed, layers, kv_heads, head) in MODELS.items():
        local, most = pages_at_context(window, args.prompt, args.context, chunk)
        every = windowed == layers
        split = (before * (layers - windowed) + local * windowed) / layers  # in pages of every layer
        rows[name] = {"window": window, "windowed_layers": f"{windowed}/{layers}", "before": before,
                      "after": local if every else before, "most_held": most if every else before,
                      "split_tables_projection": None if every else round(split, 1),
                      "page_mib": 2 * layers * kv_heads * head * 2 * PAGE / 2**20}
    if args.json:
        print(json.dumps({"context": args.context, "page_size": PAGE, "chunk": chunk, "models": rows}))
        return
    print(f"KV pages per request at {args.context} positions (page {PAGE}, chunk {chunk}; a CPU count)")
    print(f"{'model':18} {'window':>6} {'windowed':>9} {'before':>7} {'after':>6} {'most':>5} {'split tables':>12}"
          f" {'MiB/page':>8}")
    for name, r in rows.items():
        split = "-" if r["split_tables_projection"] is None else f"{r['split_tables_projection']:.1f}"
        print(f"{name:18} {r['window']:>6} {r['windowed_layers']:>9} {r['before']:>7} {r['after']:>6} "
              f"{r['most_held']:>5} {split:>12} {r['page_mib']:>8.1f}")


if __name__ == "__main__":
    main()
