"""A streaming chat session of many generated tokens over one ring KV cache, in constant memory.

    python benchmarks/streaming/chat_stream.py --tokens 50000 --device cuda --out DIR
    python benchmarks/streaming/chat_stream.py --model tiny:llama --tokens 800 --sinks 2 --kv-window 30 --out DIR

The session is runtime.decoding.ring_chat.ChatSession (what `enginesmith chat --kv ring` runs): user turns
from a fixed rotation, replies sampled (seeded) up to --turn-tokens each, one cache for the whole
session, no history kept. Every --every generated tokens it records the process RSS (VmRSS), the
ring cache's bytes and, on CUDA, this process's GPU memory (nvidia-smi). Writes chat_stream.json
(+ .png); "rss_growth_mib" compares the end with the first sample after --warmup tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import common  # noqa: E402

from enginesmith.measure.speed import rss_mib  # noqa: E402
from enginesmith.runtime.text.chat import stop_token_ids  # noqa: E402
from enginesmith.runtime.decoding.generate import GenerationConfig  # noqa: E402
from enginesmith.runtime.decoding.ring_chat import ChatSession  # noqa: E402
from enginesmith.runtime.decoding.sampling import SamplingParams  # noqa: E402

TURNS = ["Tell me a long story about a lighthouse keeper.", "Go on, what happened next?",
         "Describe the town near the lighthouse in detail.", "Continue the story.",
         "What did the keeper write in the logbook that night?", "Keep going, please."]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--tokens", type=int, default=50000, help="generated tokens in the session")
    p.add_argument("--sinks", type=int, default=4)
    p.add_argument("--kv-window", type=int, default=1020)
    p.add_argument("--turn-tokens", type=int, default=400)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=2000, help="tokens before the RSS baseline sample")
    p.add_argument("--out", default="benchmarks/streaming/results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        common.strict_fp32_cuda()
    loaded = common.open_engine(args.model, args.device, "ring", args.sinks, args.kv_window)
    config = GenerationConfig(max_new_tokens=args.turn_tokens, sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=0),
                              stop_token_ids=stop_token_ids(loaded.tokenizer, loaded.manifest))
    session = ChatSession(loaded.engine, loaded.tokenizer, config, pad_id=loaded.pad_id)
    samples, next_sample, started = [], 0, time.time()
    excerpt = ""
    while session.generated < args.tokens:
        reply = "".join(session.turn(TURNS[session.turns % len(TURNS)]))
        if session.turns <= 2:
            excerpt += reply[:300] + "\n---\n"
        if session.generated >= next_sample:
            samples.append({"generated": session.generated, "turns": session.turns, "seconds": round(time.time() - started, 1),
                            "rss_mib": rss_mib()["rss_mib"], "cache_mib": round(session.cache.nbytes() / 2**20, 3),
                            "cache_tokens": int(session.cache.count[0]), "gpu_mib": common.gpu_mib() if args.device == "cuda" else None})
            print(json.dumps(samples[-1]), flush=True)
            next_sample += args.every
    seconds = time.time() - started
    base = next((s for s in samples if s["generated"] >= args.warmup), samples[0])
    rss = [s["rss_mib"] for s in samples if s["generated"] >= base["generated"]]
    result = {"model": args.model or "SmolLM2-135M-Instruct", "device": common.device_name(args.device),
              "sinks": args.sinks, "window": args.kv_window, "generated_tokens": session.generated,
              "turns": session.turns, "seconds": round(seconds, 1), "ms_per_token": round(1000 * seconds / session.generated, 2),
              "tokens_through_cache": int(session.cache.count[0]),
              "cache_mib": samples[-1]["cache_mib"], "rss_baseline_mib": base["rss_mib"], "rss_last_mib": samples[-1]["rss_mib"],
              "rss_max_after_warmup_mib": max(rss), "rss_growth_mib": round(samples[-1]["rss_mib"] - base["rss_mib"], 1),
              "gpu_mib_first": samples[0]["gpu_mib"], "gpu_mib_last": samples[-1]["gpu_mib"],
              "samples": samples, "excerpt": excerpt}
    (out / "chat_stream.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("samples", "excerpt")}))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot([s["generated"] for s in samples], [s["rss_mib"] for s in samples], label="process RSS (MiB)")
        if samples[0]["gpu_mib"] is not None:
            ax.plot([s["generated"] for s in samples], [s["gpu_mib"] for s in samples], label="GPU memory (MiB)")
        ax.set_xlabel("generated tokens")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)
        ax.set_title(f"chat --kv ring ({args.sinks}+{args.kv_window}): {session.generated} tokens, {session.turns} turns")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out / "chat_stream.png", dpi=110)
    except ImportError:
        pass


if __name__ == "__main__":
    main()
