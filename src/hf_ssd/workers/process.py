"""The draft side in its own process: no GIL shared with the target, its own threads (or its own GPU).

The child owns the draft model (sent once through shared memory) and, per generation, a SaguaroDrafter; the
parent sends each command over a pipe. `begin` is not answered, so the child builds the speculation cache while
the parent's target verifies. A dead or failing child raises in the parent, and the engine falls back to the exact
synchronous path.

Starting a process costs seconds (imports, moving the weights to shared memory). To pay it once, keep one:

    with hf_ssd.DraftProcess(draft) as worker:
        for prompt in prompts:
            target.generate(prompt, assistant_model=draft, ssd=True, ssd_worker=worker)

Without such a handle, every generate() starts its own process and ends it before returning.
"""
from __future__ import annotations

import traceback

import torch
import torch.multiprocessing as mp

from hf_ssd.config import SSDConfig
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.quant import quantized_draft, unquantized
from hf_ssd.core.types import DraftResult, Speculation, Verdict
from hf_ssd.draft.protocol import Drafter
from hf_ssd.runtime.stats import SSDStats

# Stats the child's drafter maintains and the parent reports.
SHARED_STATS = ("cache_lookups", "cache_hits", "backup_rounds", "fanout_after_hit", "fanout_after_miss", "budget",
                "alpha", "power_r", "backup_threshold")


def _serve(conn, model, quantize) -> None:
    from hf_ssd.draft.saguaro import SaguaroDrafter

    torch.set_grad_enabled(False)
    model = quantized_draft(model, quantize)
    conn.send(("ok", "ready"))
    drafter = draft = stats = None
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
            if cmd == "setup":  # a new generation: fresh caches, options and RNG state
                vocab, warpers, greedy, downweight, rng_state, config_dict, budget, started, threads = args
                if threads is not None:
                    torch.set_num_threads(threads)
                generator = None
                if rng_state is not None:  # continue the parent's draft RNG stream: same samples as inline
                    generator = torch.Generator()
                    generator.set_state(rng_state)
                draft = DraftModel(model, 0, vocab, warpers, greedy, downweight, generator)
                stats = SSDStats()
                stats.started = started
                drafter = SaguaroDrafter(draft, SSDConfig.from_dict(config_dict), stats, budget, greedy)
                failed = None
                conn.send(("ok", None))
                continue
            if cmd == "release":
                drafter = draft = stats = None
                conn.send(("ok", None))
                continue
            if failed is not None:
                raise RuntimeError(failed)
            if cmd == "start":
                conn.send(("ok", drafter.start(*args)))
            elif cmd == "begin":
                drafter.begin(*args)
            elif cmd == "resolve":
                result = drafter.resolve(*args)
                info = {name: getattr(stats, name) for name in SHARED_STATS}
                conn.send(("ok", (result, info, drafter.forwards)))
        except Exception:
            failed = traceback.format_exc(limit=3)
            if cmd != "begin":  # begin is not answered; its failure is reported by the next call
                conn.send(("error", failed))


class DraftProcess:
    """A process that owns a draft model; reusable across generate() calls (see the module docstring)."""

    def __init__(self, draft_model, quantize: str | None = None, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.model = draft_model
        source, mode = unquantized(quantized_draft(draft_model, quantize))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, source, mode), name="hf-ssd-draft-process",
                                   daemon=True)
        self.process.start()
        child.close()
        self._answer("start-up")  # pay the start-up here, not inside the first generation

    def alive(self) -> None:
        if not self.process.is_alive():
            raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})")

    def send(self, *msg) -> None:
        self.alive()
        self.conn.send(msg)

    def call(self, *msg):
        self.send(*msg)
        return self._answer(msg[0])

    def _answer(self, what: str):
        if not self.conn.poll(self.timeout_s):
            raise TimeoutError(f"the draft process did not answer `{what}` within {self.timeout_s:.0f} s")
        try:
            status, payload = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"the draft process failed:\n{payload}")
        return payload

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

    def __enter__(self) -> DraftProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProcessDrafter(Drafter):
    kind = "process"

    def __init__(self, draft: DraftModel, config: SSDConfig, stats: SSDStats, budget: int, greedy: bool,
                 process: DraftProcess | None = None):
        self.stats = stats
        self.remote_forwards = 0
        self.owned = process is None
        self.worker = DraftProcess(draft.kv.model) if process is None else process
        rng_state = None if draft.generator is None else draft.generator.get_state()
        self.worker.call("setup", draft.vocab_size, draft.warpers, greedy, draft.downweight, rng_state,
                         config.to_dict(), budget, stats.started, config.draft_threads)

    @property
    def forwards(self) -> int:
        return self.remote_forwards

    def start(self, prompt: torch.Tensor, mask: torch.Tensor) -> Speculation:
        return self.worker.call("start", prompt.cpu(), mask.cpu())

    def begin(self, spec: Speculation) -> None:
        self.worker.send("begin", spec)

    def resolve(self, verdict: Verdict) -> DraftResult:
        result, info, self.remote_forwards = self.worker.call("resolve", verdict)
        for name in SHARED_STATS:
            setattr(self.stats, name, info[name])
        return result

    def close(self) -> None:
        if self.owned:
            self.worker.close()
            return
        try:  # a kept worker stays up for the next generation, without this one's caches
            if self.worker.process.is_alive():
                self.worker.call("release")
        except Exception:
            pass
