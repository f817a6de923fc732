"""The draft side in its own process: no GIL shared with the target, its own threads (or its own GPU).

The child owns the draft model (sent once through shared memory) and a SaguaroDrafter; the parent sends each
command over a pipe. `begin` does not wait for an answer, so the child builds the speculation cache while the
parent's target verifies. A dead or failing child raises in the parent, and the engine falls back to the exact
synchronous path.
"""
from __future__ import annotations

import traceback

import torch
import torch.multiprocessing as mp

from .config import SSDConfig
from .draft import DraftModel
from .draft_quant import quantized_draft, unquantized
from .stats import RoundRecord, SSDStats

# Stats the child's drafter maintains and the parent reports.
SHARED_STATS = ("cache_lookups", "cache_hits", "backup_rounds", "fanout_after_hit", "fanout_after_miss", "budget",
                "alpha", "power_r", "backup_threshold")


def _serve(conn, model, quantize, vocab, warpers, greedy, downweight, rng_state, config_dict, budget, started, threads) -> None:
    from .saguaro import SaguaroDrafter

    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_grad_enabled(False)
    model = quantized_draft(model, quantize)
    generator = None
    if rng_state is not None:  # continue the parent's draft RNG stream: same samples as inline
        generator = torch.Generator()
        generator.set_state(rng_state)
    draft = DraftModel(model, 0, vocab, warpers, greedy, downweight, generator)
    stats = SSDStats()
    stats.started = started
    drafter = SaguaroDrafter(draft, SSDConfig.from_dict(config_dict), stats, budget, greedy)
    failed: str | None = None
    while True:
        try:
            cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "close":
            conn.send(("ok", None))
            return
        try:
            if failed is not None:
                raise RuntimeError(failed)
            if cmd == "start":
                conn.send(("ok", drafter.start(*args)))
            elif cmd == "begin":
                drafter.begin(*args)
            elif cmd == "resolve":
                outcome, keep, contexts, verify_s = args
                stats.timeline = [RoundRecord(0.0, verify_s)]
                spec = drafter.resolve(outcome, keep, contexts)
                info = {name: getattr(stats, name) for name in SHARED_STATS}
                info.update(last_hits=drafter.last_hits, last_backup=drafter.last_backup,
                            draft_span=drafter.draft_span, draft_forwards=draft.kv.forwards)
                conn.send(("ok", (spec, info)))
        except Exception:
            failed = traceback.format_exc(limit=3)
            if cmd != "begin":  # begin is not answered; its failure is reported by the next call
                conn.send(("error", failed))


class ProcessDrafter:
    kind = "process"

    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool,
                 timeout_s: float = 600.0):
        self.stats, self.timeout_s = stats, timeout_s
        self.last_hits = None
        self.last_backup = None
        self.draft_span = None
        self.remote_forwards = 0
        rng_state = None if draft.generator is None else draft.generator.get_state()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_serve,
            args=(child, *unquantized(draft.kv.model), draft.vocab_size, draft.warpers, greedy, draft.downweight, rng_state,
                  config.to_dict(), budget, stats.started, config.draft_threads),
            name="hf-ssd-draft-process",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.device = draft.kv.device

    def _call(self, *msg):
        self.conn.send(msg)
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the draft process did not answer `{msg[0]}` within {self.timeout_s:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"the draft process failed:\n{payload}")
        return payload

    def _alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})")

    def start(self, prompt, mask):
        self._alive()
        return self._call("start", prompt.cpu(), mask.cpu())

    def begin(self, spec) -> None:
        self._alive()
        self.conn.send(("begin", spec))

    def resolve(self, outcome, keep, contexts):
        self._alive()
        last = self.stats.timeline[-1] if self.stats.timeline else None
        verify_s = (last.verify_end - last.verify_start) if last is not None else 0.0
        spec, info = self._call("resolve", outcome, keep, contexts, verify_s)
        for name in SHARED_STATS:
            setattr(self.stats, name, info[name])
        self.last_hits, self.last_backup, self.draft_span = info["last_hits"], info["last_backup"], info["draft_span"]
        self.remote_forwards = info["draft_forwards"]
        return spec

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(("close",))
                if self.conn.poll(10):
                    self.conn.recv()
            except (OSError, EOFError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
        self.conn.close()
