"""The draft side in its own process: no GIL shared with the target, its own threads (or its own GPU).

The child owns the draft model (sent once through shared memory) and, per generation, a SaguaroDrafter; the
parent sends each command over a pipe. `begin` is not answered, so the child builds the speculation cache while
the parent's target verifies. A dead or failing child raises in the parent, and the engine falls back to the exact
synchronous path.

Starting a process costs seconds (imports, moving the weights to shared memory). To pay it once, keep one:

    with hf_ssd.DraftProcess(draft) as worker:
        for prompt in prompts:
            target.generate(prompt, assistant_model=draft, ssd=True, ssd_worker=worker)

Without such a handle, every generate() starts its own process and ends it before returning. The drafter that
talks to the child each round is `workers.process_drafter.ProcessDrafter`.

The child is started with multiprocessing's "spawn": it imports your main module again. A script that creates a
DraftProcess (or uses ssd_worker="process") at module level must guard that code with `if __name__ == "__main__":`,
or the child runs the script again and fails to start.

Robustness: every request carries a sequence number and the child echoes it, so a reply left behind by an
interrupted call (Ctrl-C while waiting) is drained, never taken for the answer to a later request; a request
interrupted while it was being written leaves the pipe unusable, and the process is restarted at the next
generation. The child ignores SIGINT (a Ctrl-C reaches the whole process group): the parent decides. One
generation at a time uses a DraftProcess: a second thread waits for the first one's generation to end.

The per-round hand-over goes through fixed shared memory (`Exchange`): once per generation, after `start`, the
parent allocates a few shared CPU tensors sized for the batch and sends them to the child; from then on `begin`
and `resolve` only write into them and put a small control message on the pipe (command, sequence number, row
counts, a few numbers). No tensor, file descriptor or shared-memory segment is created per round.
"""
from __future__ import annotations

import signal
import threading
import time
import traceback

import torch
import torch.multiprocessing as mp

from hf_ssd.config import SSDConfig
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.quant import quantized_draft, unquantized
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.workers.exchange import Exchange

# Requests the child does not answer (the parent does not wait for them). Requests that carry tensors are all
# answered: a tensor travels as a file descriptor the child fetches from the parent while unpickling, and a child
# ended (restarted) before fetching it would leave the parent holding that descriptor.
UNANSWERED = ("begin",)

# Stats the child's drafter maintains and the parent reports.
SHARED_STATS = ("cache_lookups", "cache_hits", "backup_rounds", "fanout_after_hit", "fanout_after_miss", "budget",
                "alpha", "power_r", "bonus_ranks", "backup_threshold", "draft_static", "draft_compiled",
                "draft_compile_s", "draft_step_s", "draft_forward_s", "tree_reused")


def _retire(drafter) -> None:
    """Close a finished generation's drafter, so its static cache goes back to the registry now: dropped, it goes
    back only when garbage collection reaches it, and a next generation that finds it still in use builds and
    compiles a cache of its own (the likely cause of one 10 s call on the overhead workload; not isolated)."""
    if drafter is None:
        return
    try:
        drafter.close()
    except Exception:  # noqa: BLE001 - a drafter that failed may fail to close; the next generation starts clean
        pass


def _serve(conn, model, quantize) -> None:
    """The child's loop. Requests are (seq, cmd, *args); answers are (seq, status, payload), seq echoed."""
    from hf_ssd.draft.saguaro import SaguaroDrafter
    from hf_ssd.draft.static_saguaro import StaticSaguaroDrafter
    from hf_ssd.runtime.static_choice import static_draft_cache

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the parent's to handle
    torch.set_grad_enabled(False)
    model = quantized_draft(model, quantize)
    conn.send((0, "ok", "ready"))
    drafter = draft = stats = exchange = None
    failed: str | None = None
    begin_end: float | None = None  # when the current round's `begin` finished (perf_counter)
    while True:
        try:
            seq, cmd, *args = conn.recv()
        except EOFError:
            return
        if cmd == "close":
            conn.send((seq, "ok", None))
            return
        try:
            if cmd == "setup":  # a new generation: fresh caches, options and RNG state
                (vocab, warpers, greedy, downweight, rng_state, config_dict, budget, started, threads, batch,
                 max_length) = args
                if threads is not None:
                    torch.set_num_threads(threads)
                generator = None
                if rng_state is not None:  # continue the parent's draft RNG stream: same samples as inline
                    generator = torch.Generator()
                    generator.set_state(rng_state)
                _retire(drafter)
                drafter = draft = stats = exchange = None
                failed = None
                config = SSDConfig.from_dict(config_dict)
                # ssd_compile: the static (compiled) cache lives here, with the model; its buffers and graphs stay
                # for the next generation of a kept DraftProcess
                kv = None
                if max_length is not None:
                    kv = static_draft_cache(model, config, batch, max_length, config.num_draft_tokens, budget, vocab)
                draft = DraftModel(model, batch, vocab, warpers, greedy, downweight, generator, kv, config.packed_linear)
                stats = SSDStats()
                stats.started = started
                drafter_class = SaguaroDrafter if kv is None else StaticSaguaroDrafter
                drafter = drafter_class(draft, config, stats, budget, greedy)
                conn.send((seq, "ok", None))
                continue
            if cmd == "release":
                _retire(drafter)
                drafter = draft = stats = exchange = None
                failed = None
                conn.send((seq, "ok", None))
                continue
            if failed is not None:
                raise RuntimeError(failed)
            if drafter is None:
                raise RuntimeError(f"`{cmd}` arrived outside a generation (no `setup` before it)")
            if cmd == "start":  # once per generation: pickled
                exchange = None
                conn.send((seq, "ok", drafter.start(*args)))
            elif cmd == "exchange":  # the buffers of this generation's rounds
                exchange = Exchange.attach(*args)
                conn.send((seq, "ok", None))
            elif cmd == "contexts":  # a grown contexts buffer
                (exchange.contexts,) = args
                conn.send((seq, "ok", None))
            elif cmd == "begin":
                (rows,) = args
                begin_end = None
                drafter.begin(exchange.read_spec(rows))
                begin_end = time.perf_counter()
            elif cmd == "resolve":
                rows, kept, verify_s = args
                verdict = exchange.read_verdict(rows, kept, verify_s)
                t0 = time.perf_counter()
                result = drafter.resolve(verdict)
                compute_s = time.perf_counter() - t0
                shape = exchange.write_result(result)
                info = {name: getattr(stats, name) for name in SHARED_STATS}
                conn.send((seq, "ok", (*shape, result.backup, result.draft_span, result.draft_s, info,
                                       drafter.forwards, compute_s, begin_end)))
                begin_end = None
                try:  # learning from the round, once the parent has its answer (off the round's critical path)
                    drafter.settle()
                except Exception:  # reported at the next request, which falls back
                    failed = traceback.format_exc(limit=3)
            elif cmd == "stats":  # the generation's end: the last round's learning, and the stats it changed
                drafter.settle()
                conn.send((seq, "ok", {name: getattr(stats, name) for name in SHARED_STATS}))
            else:
                raise RuntimeError(f"unknown command {cmd!r}")
        except Exception:
            failed = traceback.format_exc(limit=3)
            if cmd not in UNANSWERED:  # their failure is reported by the next call
                conn.send((seq, "error", failed))


START_HINT = (
    "The child is started with multiprocessing's 'spawn' and imports your main module again: if your script "
    "creates a DraftProcess or calls generate(..., ssd_worker=\"process\") at module level, put that code under "
    "`if __name__ == \"__main__\":`."
)


class DraftProcess:
    """A process that owns a draft model; reusable across generate() calls (see the module docstring).

    Create it under `if __name__ == "__main__":` in a script: the spawned child imports the main module again.
    A generation interrupted by Ctrl-C leaves it usable: stale replies are drained by sequence number, and a pipe
    left mid-message is replaced by a fresh process at the next generation. Several threads may share one: each
    generation holds it from start to end, so a second thread's generate() waits for the first one's to finish.
    """

    def __init__(self, draft_model, quantize: str | None = None, timeout_s: float = 600.0):
        self.timeout_s = timeout_s
        self.model = draft_model
        self._source = unquantized(quantized_draft(draft_model, quantize))
        self._seq = 0
        self._broken: str | None = None  # why the pipe cannot be trusted any more (a restart fixes it)
        self.closed = False
        self.restarts = 0
        self._lock = threading.Lock()  # held by one generation from setup to release
        self._owner: int | None = None
        self.conn = self.process = None
        self._spawn()

    # ---- the child ------------------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, *self._source), name="hf-ssd-draft-process",
                                   daemon=True)
        self.process.start()
        child.close()
        self._seq = 0
        self._broken = None
        try:
            self._answer("start-up", 0)  # pay the start-up here, not inside the first generation
        except BaseException as exc:
            self._stop_child()
            if isinstance(exc, Exception):
                raise RuntimeError(f"the draft process failed to start ({exc}). {START_HINT}") from exc
            raise

    def restart(self) -> None:
        """End the child (whatever state it is in) and start a fresh one on the same draft model."""
        self._check_open()
        self._stop_child()
        self.restarts += 1
        self._spawn()

    def _stop_child(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(timeout=5)
        if self.conn is not None:
            self.conn.close()

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the DraftProcess was closed; create a new one (hf_ssd.DraftProcess(draft)) or drop "
                               "ssd_worker=... to let each generate() start its own")

    def alive(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise RuntimeError(f"the draft process pipe is out of step ({self._broken}); it is restarted at the "
                               "next generation")
        if not self.process.is_alive():
            raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})")

    # ---- generations ----------------------------------------------------------------------------------------------
    def acquire(self) -> None:
        """Hold the process for one generation (waits while another thread's generation holds it)."""
        self._check_open()
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("this DraftProcess is already serving a generation in this thread (generate() called "
                               "from inside a generation, e.g. from a stopping criterion or streamer); use another "
                               "DraftProcess or ssd_worker=\"thread\" for the inner call")
        self._lock.acquire()
        self._owner = me
        try:
            self._check_open()
            if self._broken is not None:  # an earlier generation was interrupted mid-message
                self.restart()
        except BaseException:
            self.release()
            raise

    @property
    def busy(self) -> bool:
        """Is a generation (in any thread) holding the process right now?"""
        return self._lock.locked()

    def release(self) -> None:
        if self._owner == threading.get_ident():
            self._owner = None
            self._lock.release()

    # ---- requests ---------------------------------------------------------------------------------------------------
    def send(self, cmd: str, *args) -> int:
        """Send a request; returns its sequence number."""
        self.alive()
        self._seq += 1
        try:
            self.conn.send((self._seq, cmd, *args))
        except BaseException as exc:  # interrupted mid-write: the child may hold half a message
            if not isinstance(exc, OSError):  # a broken pipe is a dead child, reported as such by the next call
                self._broken = f"`{cmd}` was interrupted while being sent ({type(exc).__name__})"
            raise
        return self._seq

    def call(self, cmd: str, *args):
        return self._answer(cmd, self.send(cmd, *args))

    def _answer(self, what: str, seq: int):
        """The answer to request `seq`; answers to earlier requests (left by an interrupted call) are dropped."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            # Waiting is safe to interrupt: the answer stays in the pipe and a later call drains it.
            if not self.conn.poll(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the draft process did not answer `{what}` within {self.timeout_s:.0f} s")
            try:
                got, status, payload = self.conn.recv()
            except EOFError:
                self.process.join(timeout=5)
                if what == "start-up":
                    raise RuntimeError(f"the draft process died while starting (exit code {self.process.exitcode})"
                                       ) from None
                raise RuntimeError(f"the draft process died (exit code {self.process.exitcode})") from None
            except BaseException as exc:  # interrupted mid-read: the rest of the message is still in the pipe
                if not isinstance(exc, OSError):
                    self._broken = f"reading the answer to `{what}` was interrupted ({type(exc).__name__})"
                raise
            if got != seq:
                continue  # a stale answer to an interrupted request
            if status == "error":
                raise RuntimeError(f"the draft process failed:\n{payload}")
            return payload

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.process.is_alive() and self._broken is None:
            try:
                self._seq += 1
                self.conn.send((self._seq, "close"))
                deadline = time.monotonic() + 10
                while self.conn.poll(max(0.0, deadline - time.monotonic())):
                    if self.conn.recv()[0] == self._seq:
                        break
            except (OSError, EOFError):
                pass
            self.process.join(timeout=10)
        self._stop_child()

    def __enter__(self) -> DraftProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if not self.closed and self.process is not None and self.process.is_alive():
                self._stop_child()
        except Exception:
            pass

