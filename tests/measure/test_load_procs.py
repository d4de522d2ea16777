"""`enginesmith bench serve --procs K` (enginesmith/measure/load_procs.py): one run's load split over K worker
processes, merged into one summary.

Oracles: the stand-in server tests/helpers/sse_server.py (it streams exactly max_tokens tokens " t0 t1 ...", records
each request's body and arrival, counts the requests it holds at once), the one-process run of
http_load.run_load on the same workload, and a real `enginesmith serve` of a tiny paged engine.
- dealing: requests, due times, slots and warm-up round-robin; --procs auto;
- K = 2: every request sent once (no request lost or duplicated), each outcome back at its request's
  place, the merged figures equal one process's (requests, tokens, in flight), from one shared start;
- open loop: the server sees the one-process Poisson schedule, whatever K;
- failures: a worker that raises, a worker killed mid-run, Ctrl-C: one line, and no process left;
- the CLI against `enginesmith serve`: --procs 2 counts the same tokens as --procs 1 (--ignore-eos).
Every server is stopped by PID; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from enginesmith.core.errors import UserError
from enginesmith.measure import http_load, load_procs
from enginesmith.measure.http_load import Prompt
from test_bench_serve import KEY, _prompts, _stats, _target, server  # noqa: F401  (server: the fixture)
from helpers.cli import assert_one_line_error, cli

READY = re.compile(r"enginesmith serve: (http://127\.0\.0\.1:\d+)")


def test_deal_splits_requests_slots_schedule_and_warmup():
    prompts = _prompts(range(1, 11))
    due = np.arange(10) * 0.1
    jobs = load_procs.deal(_target("http://h"), prompts, 5, due, 5, 7.0, 3)
    assert [j.prompts for j in jobs] == [tuple(prompts[0::3]), tuple(prompts[1::3]), tuple(prompts[2::3])]
    assert [j.concurrency for j in jobs] == [2, 2, 1] and [j.warmup for j in jobs] == [2, 2, 1]
    assert [list(j.due) for j in jobs] == [list(due[0::3]), list(due[1::3]), list(due[2::3])]
    assert all(j.timeout == 7.0 for j in jobs)
    assert load_procs.deal(_target("h"), prompts, 2, None, 0, 1, 2)[0].due is None  # closed loop
    assert load_procs.procs_for(4, 3, 100) == 3 and load_procs.procs_for(4, 64, 2) == 2  # at most C and N
    assert load_procs.procs_for("auto", 16, 100) == 1
    assert load_procs.procs_for("auto", 128, 1000) == min(os.cpu_count(), 4)
    with pytest.raises(UserError, match="procs=0"):
        load_procs.procs_for(0, 4, 4)


def test_two_procs_send_every_request_once_and_merge_like_one(server):
    lengths = list(range(5, 21))  # distinct: an outcome in the wrong place shows
    prompts = _prompts(lengths)
    target = _target(server, first_delay=0.02, delay=0.002)
    _stats(server, reset=True)
    warm, shares, t0 = load_procs.run_workers(load_procs.deal(target, prompts, 4, None, 4, 30.0, 2))
    seen = _stats(server, reset=True)
    outcomes = [None] * len(prompts)
    outcomes[0::2], outcomes[1::2] = shares
    for o, p in zip(outcomes, prompts):  # each request's own stream, at its place
        assert o.error_kind is None and o.usage_tokens == p.max_tokens and o.sent >= t0
        assert o.text == [f" t{j}" for j in range(p.max_tokens)]
    assert len(warm) == 4 and all(o.error_kind is None for o in warm)
    sent = sorted((b["prompt"], b["max_tokens"]) for b in seen["bodies"] if b["max_tokens"] > 4)
    assert sent == sorted((p.text, p.max_tokens) for p in prompts)  # each once: none lost, none twice
    assert seen["requests"] == len(prompts) + 4 and seen["max_in_flight"] == 4

    one = load_procs.run_load(target, prompts, 4, procs=1)
    two = load_procs.run_load(target, prompts, 4, procs=2)
    _stats(server, reset=True)
    assert one["procs"] == 1 and two["procs"] == 2
    for key in ("requests", "completed", "output_tokens", "prompt_tokens", "chunks", "max_in_flight",
                "warmup_requests", "tokens_counted_by"):
        assert two[key] == one[key], key
    assert two["output_tokens"] == sum(lengths) and two["errors"]["total"] == 0 and two["max_in_flight"] == 4
    # the one summary: tokens over the time from the shared start to the last end
    assert two["tok_s"] == pytest.approx(two["output_tokens"] / two["seconds"])
    assert two["ttft_ms"]["p50"] >= 20 and two["itl_ms"]["p50"] >= 2


def test_open_loop_keeps_the_one_process_schedule(server):
    rate, n, seed = 25.0, 30, 2
    _stats(server, reset=True)
    r = load_procs.run_load(_target(server, first_delay=0.01), _prompts([6] * n), n, rate, procs=3, seed=seed)
    seen = _stats(server, reset=True)
    arrivals = [a for a, body in zip(seen["arrivals"], seen["bodies"]) if body["max_tokens"] == 6]  # not warm-up
    due = http_load.arrival_times(n, rate, seed)
    assert r["procs"] == 3 and r["completed"] == n and r["warmup_requests"] == n and r["wait_ms"]["p99"] < 20
    # as the server saw them: the one-process schedule, each within a few ms (shared t0, no drift)
    assert [a - arrivals[0] for a in arrivals] == pytest.approx(list(due), abs=0.04)
    assert r["arrival_rate"] == pytest.approx((n - 1) / due[-1], rel=0.05)


def test_a_worker_that_raises_is_one_user_error(server):
    prompts = [Prompt("fine", 1, 2), Prompt(b"not text", 1, 2)]  # the second worker cannot encode its body
    with pytest.raises(UserError, match=r"load worker 2 of 2 failed: TypeError: .*bytes.* JSON") as err:
        load_procs.run_load(_target(server), prompts, 2, procs=2, warmup=0)
    assert "--procs 1" in err.value.fix


def _children(pid: int) -> list[int]:
    """The live child processes of `pid` that are multiprocessing workers."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z" and b"spawn_main" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("how", ["kill a worker", "ctrl-c"])
def test_a_dead_worker_or_ctrl_c_ends_the_run_in_one_line_and_leaves_no_process(server, austen, how):
    _stats(server, reset=True)
    cmd = [sys.executable, "-m", "enginesmith.cli", "bench", "serve", "--url", server, "--api-key", KEY,
           "--concurrency", "4", "--requests", "8", "--prompt-tokens", "8", "--new-tokens", "400",
           "--tokenizer", "tiny:llama", "--procs", "2", "--extra-body", '{"delay": 0.05, "first_delay": 0.01}']
    # SIGINT as a terminal gives it: a test run started in the background (`pytest &`) ignores SIGINT, and
    # a child would inherit that, so Python would install no KeyboardInterrupt handler in it
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        workers: list[int] = []
        while time.monotonic() < deadline and (len(workers) < 2 or _stats(server)["requests"] < 4 + 4):
            workers = _children(proc.pid)  # both workers up, the warm-up done, the run's 4 streams open
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.1)
        assert len(workers) == 2 and _stats(server)["in_flight"] == 4
        if how == "kill a worker":
            os.kill(workers[0], signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert all(_gone(pid) for pid in workers)  # the other worker was stopped, not orphaned
    if how == "kill a worker":
        assert_one_line_error(subprocess.CompletedProcess(cmd, proc.returncode, "", err), 2,
                              f"load worker 1 of 2 (pid {workers[0]}) was killed by signal 9")
    else:
        assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err


@pytest.fixture(scope="module")
def tiny_serve(tmp_path_factory):
    """The URL and engine of `enginesmith serve` over a tiny paged CPU engine (stopped by PID)."""
    from enginesmith.builder.engine import BuildConfig, cached_engine

    engine = cached_engine(BuildConfig(model="tiny:llama", kv_layout="paged"), progress=False)
    log = tmp_path_factory.mktemp("serve") / "out.txt"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "enginesmith.cli", "serve", "--engine", str(engine), "--port",
                                 "0", "--threads", "1"], stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (match := READY.search(log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        yield match.group(1), engine
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_cli_procs_2_counts_what_procs_1_counts_against_enginesmith_serve(tiny_serve, austen):
    url, engine = tiny_serve
    runs = {}
    for procs in ("1", "2"):
        result = cli("bench", "serve", "--url", url, "--concurrency", "4", "--requests", "8", "--prompt-tokens", "8",
                     "--new-tokens", "6", "--tokenizer", str(engine), "--ignore-eos", "--procs", procs, "--json",
                     timeout=120)
        assert result.returncode == 0, result.stderr
        runs[procs] = json.loads(result.stdout)
    assert runs["1"]["procs"] == 1 and runs["2"]["procs"] == 2
    one, two = runs["1"]["runs"][0], runs["2"]["runs"][0]
    assert one["procs"] == 1 and two["procs"] == 2
    assert two["completed"] == one["completed"] == 8 and two["errors"]["total"] == 0
    assert two["output_tokens"] == one["output_tokens"] == 8 * 6 and two["tokens_counted_by"] == {"usage": 8}
    assert two["prompt_tokens"] == one["prompt_tokens"] and two["max_in_flight"] <= 4


@pytest.mark.parametrize("value", ["0", "two", "-1"])
def test_bad_procs_flag(value):
    assert_one_line_error(cli("bench", "serve", "--url", "http://h", "--requests", "2", "--procs", value), 2,
                          f"--procs {value!r}")
