"""Soak test (not in CI): many generate() calls on one kept DraftProcess and on the thread worker, with random
interrupts, random draft failures and mixed batch sizes; checks every completed greedy output against plain
generate() and watches memory, file descriptors, threads and child processes for growth.

    .venv/bin/python scripts/soak.py                 # 1000 calls (alternating process / thread worker)
    .venv/bin/python scripts/soak.py -n 100 --seed 1 # a quick run

Faults injected (each with its own probability per call):
- interrupt:        a stopping criterion raises KeyboardInterrupt on a random call (the user's Ctrl-C);
- interrupt-wait:   (process) Ctrl-C while the parent waits for the child's answer;
- interrupt-write:  (process) Ctrl-C in the middle of writing a request (the pipe is left mid-message: the
                    DraftProcess must restart its child at the next generation);
- draft failure:    the draft model's forward raises at a random round (thread), or the child is sent a malformed
                    request (process): the generation must fall back and still equal plain greedy.

Writes benchmarks/soak/summary.json and prints a short table; exits 1 if any output differed, anything leaked or
memory grew. Run it under `if __name__ == "__main__":` (it does): the process worker spawns.
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import random
import struct
import sys
import threading
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import StoppingCriteriaList

import hf_ssd
from hf_ssd.testing import PAD, VOCAB, InterruptOnCall, get_pair, plain_generate
from hf_ssd.workers.process_drafter import ProcessDrafter
from hf_ssd.workers.thread import live_worker_threads

ROOT = Path(__file__).resolve().parents[1]


# ---- measuring the process ----------------------------------------------------------------------------------------
def rss_mb(pid: int | None = None) -> float:
    try:
        import psutil

        return psutil.Process(pid or os.getpid()).memory_info().rss / 2**20
    except ImportError:
        with open(f"/proc/{pid or 'self'}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except Exception:  # noqa: BLE001 - the child may be restarting
        return float("nan")
    return float("nan")


def open_fds() -> int:
    try:
        import psutil

        return psutil.Process().num_fds()
    except ImportError:
        return len(os.listdir("/proc/self/fd"))


def hf_children() -> list:
    return [c for c in multiprocessing.active_children() if c.name.startswith("hf-ssd")]


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return 0.0
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    return 0.0 if var == 0 else sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var


# ---- faults -----------------------------------------------------------------------------------------------------
class ConnFaults:
    """The parent's end of the pipe, with a Ctrl-C on the n-th poll or in the middle of the n-th send."""

    def __init__(self, conn, poll_at: int | None = None, send_at: int | None = None):
        self.conn, self.poll_at, self.send_at = conn, poll_at, send_at
        self.polls = self.sends = 0

    def poll(self, *args):
        self.polls += 1
        if self.polls == self.poll_at:
            self.conn.poll(30)
            raise KeyboardInterrupt
        return self.conn.poll(*args)

    def send(self, msg):
        self.sends += 1
        if self.sends == self.send_at:
            self.conn._send(struct.pack("!i", 1 << 16) + b"\x80\x05half a message")
            raise KeyboardInterrupt
        return self.conn.send(msg)

    def __getattr__(self, name):
        return getattr(self.conn, name)


class DraftFaults:
    """Makes the draft side fail at a random round of the current call (armed per call)."""

    def __init__(self, draft):
        self.draft = draft
        self.fail_at: int | None = None
        self.count = 0
        self.original_begin = ProcessDrafter.begin
        faults = self

        def begin(drafter, spec):
            faults.count += 1
            if faults.fail_at is not None and faults.count == faults.fail_at:
                return drafter.worker.send("begin", "a malformed speculation")  # the child fails on it
            return faults.original_begin(drafter, spec)

        ProcessDrafter.begin = begin

    def arm(self, fail_at: int | None, in_process: bool) -> None:
        self.fail_at, self.count = fail_at, 0
        if fail_at is not None and not in_process:
            forward = type(self.draft).forward

            def flaky(*args, **kwargs):
                self.count += 1
                if self.count == self.fail_at:
                    raise RuntimeError("soak: injected draft forward failure")
                return forward(self.draft, *args, **kwargs)

            self.draft.forward = flaky

    def disarm(self) -> None:
        self.fail_at = None
        self.draft.__dict__.pop("forward", None)  # never pickled into a restarted child


# ---- the run ----------------------------------------------------------------------------------------------------
def make_prompts(n: int, rng: random.Random) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for i in range(n):
        B = rng.randint(1, 4)
        P = rng.randint(4, 14)
        g = torch.Generator().manual_seed(10_000 + i)
        ids = torch.randint(2, VOCAB - 1, (B, P), generator=g)
        mask = torch.ones_like(ids)
        for b in range(1, B):
            pad = rng.randint(0, P - 2)
            ids[b, :pad], mask[b, :pad] = PAD, 0
        out.append((ids, mask))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--calls", type=int, default=1000, help="generate() calls in all (alternating workers)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", default="process,thread", help="comma-separated: process (kept), thread")
    ap.add_argument("--p-interrupt", type=float, default=0.10, help="Ctrl-C from a stopping criterion")
    ap.add_argument("--p-interrupt-wait", type=float, default=0.05, help="Ctrl-C while waiting for the child")
    ap.add_argument("--p-interrupt-write", type=float, default=0.01, help="Ctrl-C mid-request (forces a restart)")
    ap.add_argument("--p-draft-failure", type=float, default=0.10, help="draft side fails at a random round")
    ap.add_argument("--max-rss-growth-mb", type=float, default=64.0, help="allowed RSS growth after warm-up")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "soak" / "summary.json"))
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    rng = random.Random(args.seed)
    pair = get_pair("llama")
    target, draft = pair.target, pair.related
    workers = [w.strip() for w in args.workers.split(",") if w.strip()]
    prompts = make_prompts(32, rng)
    refs: dict[tuple[int, int], torch.Tensor] = {}

    kept = hf_ssd.DraftProcess(draft) if "process" in workers else None
    faults = DraftFaults(draft)
    per = {w: dict(calls=0, completed=0, interrupted=0, interrupts_injected=0, draft_failures_injected=0,
                   fallback_warnings=0, differences=0, other_errors=0) for w in workers}
    diffs: list[dict] = []
    errors: list[str] = []
    samples: list[tuple[int, float, float, int, int]] = []  # (call, rss, child rss, fds, threads)
    base_threads = threading.active_count()
    start_rss, start_fds = rss_mb(), open_fds()
    t0 = time.perf_counter()
    warmup = max(1, args.calls // 10)

    for call in tqdm(range(args.calls), desc="soak", unit="call", mininterval=2.0):
        worker = workers[call % len(workers)]
        stats = per[worker]
        stats["calls"] += 1
        pi = rng.randrange(len(prompts))
        ids, mask = prompts[pi]
        new = rng.randint(4, 24)
        K = rng.choice([2, 3, 4])
        budget = rng.choice([4, 8, 12])
        kw = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=PAD, assistant_model=draft,
                  ssd=True, ssd_mode="ssd", ssd_num_draft_tokens=K, ssd_budget=budget, ssd_draft_quantize=None,
                  ssd_worker=kept if worker == "process" else "thread")
        interrupt = None
        roll = rng.random()
        if roll < args.p_interrupt:
            interrupt = "criterion"
            kw["stopping_criteria"] = StoppingCriteriaList([InterruptOnCall(rng.randint(1, 4))])
        elif worker == "process" and roll < args.p_interrupt + args.p_interrupt_wait:
            interrupt = "wait"
        elif worker == "process" and roll < args.p_interrupt + args.p_interrupt_wait + args.p_interrupt_write:
            interrupt = "write"
        fail_at = rng.randint(1, 6) if rng.random() < args.p_draft_failure else None
        if interrupt:
            stats["interrupts_injected"] += 1
        if fail_at is not None:
            stats["draft_failures_injected"] += 1
        real_conn = kept.conn if kept is not None else None
        if interrupt in ("wait", "write"):
            kept.conn = ConnFaults(real_conn, poll_at=rng.randint(1, 4) if interrupt == "wait" else None,
                                   send_at=rng.randint(2, 5) if interrupt == "write" else None)
        faults.arm(fail_at, worker == "process")
        out = None
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with torch.no_grad():
                    out = target.generate(ids, **kw)
            stats["fallback_warnings"] += sum("hf_ssd: the draft side" in str(w.message) for w in caught)
        except KeyboardInterrupt:
            stats["interrupted"] += 1
        except Exception as exc:  # noqa: BLE001 - every error is a finding
            stats["other_errors"] += 1
            errors.append(f"call {call} ({worker}): {type(exc).__name__}: {exc}")
        finally:
            faults.disarm()
            if kept is not None and isinstance(kept.conn, ConnFaults):
                kept.conn = kept.conn.conn
        if out is not None:
            stats["completed"] += 1
            key = (pi, new)
            if key not in refs:
                refs[key] = plain_generate(target, ids, attention_mask=mask, max_new_tokens=new)
            if not torch.equal(out, refs[key]):
                stats["differences"] += 1
                diffs.append(dict(call=call, worker=worker, prompt=pi, new=new, K=K, budget=budget,
                                  interrupt=interrupt, fail_at=fail_at))
        if call % 10 == 0 or call == args.calls - 1:
            child = kept.process.pid if kept is not None and kept.process.is_alive() else None
            samples.append((call, rss_mb(), rss_mb(child) if child else float("nan"), open_fds(),
                            threading.active_count()))

    wall = time.perf_counter() - t0
    restarts = kept.restarts if kept is not None else 0
    gc.collect()
    time.sleep(1.0)
    leaked_threads = [t.name for t in live_worker_threads()]
    children_before_close = len(hf_children())
    if kept is not None:
        kept.close()
    time.sleep(0.5)
    leaked_children = [c.name for c in hf_children()]

    after = [s for s in samples if s[0] >= warmup]
    rss_after_warmup = after[0][1] if after else samples[0][1]
    end_rss, end_fds = rss_mb(), open_fds()
    child_after = [s for s in after if s[2] == s[2]]
    summary = {
        "calls": args.calls, "seed": args.seed, "workers": workers, "wall_s": round(wall, 1),
        "per_worker": per, "draft_process_restarts": restarts,
        "differences": diffs, "errors": errors[:50],
        "rss_mb": {"start": round(start_rss, 1), "after_warmup": round(rss_after_warmup, 1),
                   "end": round(end_rss, 1), "growth_after_warmup": round(end_rss - rss_after_warmup, 1),
                   "slope_kb_per_call": round(1024 * slope([s[0] for s in after], [s[1] for s in after]), 3)},
        "child_rss_mb": {"after_warmup": round(child_after[0][2], 1) if child_after else None,
                         "end": round(child_after[-1][2], 1) if child_after else None,
                         "slope_kb_per_call": round(1024 * slope([s[0] for s in child_after],
                                                                 [s[2] for s in child_after]), 3)},
        "open_fds": {"start": start_fds, "after_warmup": after[0][3] if after else start_fds, "end": end_fds,
                     "max": max(s[3] for s in samples)},
        "threads": {"start": base_threads, "end": threading.active_count(), "leaked_worker_threads": leaked_threads,
                    "names_end": sorted(t.name for t in threading.enumerate())},
        "child_processes": {"before_close": children_before_close, "after_close": leaked_children},
    }
    ok = (not diffs and not errors and not leaked_threads and not leaked_children
          and summary["rss_mb"]["growth_after_warmup"] <= args.max_rss_growth_mb
          and end_fds <= summary["open_fds"]["after_warmup"] + 8
          and children_before_close <= (1 if kept is not None else 0))
    summary["ok"] = ok
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(summary, indent=2) + "\n")

    print(f"\nsoak: {args.calls} calls in {wall:.0f} s -> {out_path}")
    cols = ["calls", "completed", "interrupted", "interrupts_injected", "draft_failures_injected",
            "fallback_warnings", "differences", "other_errors"]
    print("| worker | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for w, s in per.items():
        print(f"| {w} | " + " | ".join(str(s[c]) for c in cols) + " |")
    r = summary["rss_mb"]
    print(f"RSS MB: start {r['start']}, after warm-up {r['after_warmup']}, end {r['end']} "
          f"(growth {r['growth_after_warmup']}, slope {r['slope_kb_per_call']} KB/call); child: "
          f"{summary['child_rss_mb']}")
    print(f"fds: {summary['open_fds']}; threads: {summary['threads']}; child processes: "
          f"{summary['child_processes']}; DraftProcess restarts: {restarts}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
