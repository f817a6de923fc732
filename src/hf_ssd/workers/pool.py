"""Draft processes kept for the life of the program, so that `ssd=True` with no options can build its tree in a
process of its own (no GIL shared with the target) without paying seconds of start-up in every generate() call.

The controller asks for one when it predicts that a process worker would beat the plan it chose by a clear margin
over the call, the call's share of the process's start included (`Controller.process_option`). The process is
started when that generation ends (the draft's weights move to shared memory then, while nothing runs them), in
the background; later generate() calls with the same draft model use it once it is ready, and the controller times
it like any other plan. It is never started:
- when the environment sets HF_SSD_AUTO_PROCESS=0, or inside a process that multiprocessing started;
- when the main script runs code at import time outside `if __name__ == "__main__":`: the "spawn" start method
  imports that script again in the child, which would run that code a second time.
A DraftProcess you create yourself and pass as `ssd_worker=` is never pooled: you decide its life.
"""
from __future__ import annotations

import ast
import atexit
import multiprocessing
import os
import sys
import threading
import time
import weakref
from pathlib import Path

from hf_ssd.runtime.kv import input_device
from hf_ssd.workers.process import DraftProcess

ENV = "HF_SSD_AUTO_PROCESS"
# Seconds a kept process takes to start (spawn, the child's imports, the draft's weights), until this program has
# timed one: 4-5 s on the project's idle 2-core CPU, more while it generates. The controller charges a share of it
# to the calls that would ask for one (Controller.process_option).
START_PRIOR_S = 6.0


class _Kept:
    """One draft model's kept process: started in a background thread, ready once the child has answered."""

    def __init__(self, draft):
        self.draft = weakref.ref(draft)
        self.process: DraftProcess | None = None
        self.error: str | None = None
        # Spawning moves CPU weights into shared memory: do it here, while nothing runs the draft, not in the
        # background thread, where it could swap a weight's storage under a forward of the next generation.
        if input_device(draft).type == "cpu":
            draft.share_memory()
        self.thread = threading.Thread(target=self._start, args=(draft,), name="hf-ssd-start-draft-process",
                                       daemon=True)
        self.thread.start()

    def _start(self, draft) -> None:
        began = time.perf_counter()
        try:
            self.process = DraftProcess(draft)
        except Exception as exc:  # noqa: BLE001 - reported in ssd_stats; generation goes on in-process
            self.error = f"{type(exc).__name__}: {exc}"
        else:
            global _START_S
            _START_S = time.perf_counter() - began


_START_S: float | None = None  # how long the last kept process took to start, once one has


_KEPT: dict[int, _Kept] = {}
_LOCK = threading.Lock()


def ready(draft):
    """The kept DraftProcess of `draft` if it is up and free (not serving another thread's generation), else None."""
    kept = _KEPT.get(id(draft))
    if kept is None or kept.draft() is not draft or kept.process is None:
        return None
    process = kept.process
    if process.closed or not process.process.is_alive() or process.busy:
        return None
    return process


def status(draft) -> str | None:
    """'ready', 'starting', 'failed: ...' or None (never asked for) for `draft`'s kept process."""
    kept = _KEPT.get(id(draft))
    if kept is None or kept.draft() is not draft:
        return None
    if kept.error is not None:
        return f"failed: {kept.error}"
    return "ready" if kept.process is not None else "starting"


def start_seconds() -> float:
    """What starting a kept process costs here: the last start's seconds, else START_PRIOR_S."""
    return START_PRIOR_S if _START_S is None else _START_S


def starting() -> bool:
    """Is a kept process being started right now? Its start-up (a spawn, the child's imports and weights) takes
    CPU from whatever runs meanwhile, so timings taken then are not the plans' own."""
    return any(k.thread.is_alive() for k in list(_KEPT.values()))


def start(draft) -> str:
    """Start `draft`'s kept process in the background (once); returns what happened, for ssd_stats."""
    hazard = spawn_hazard()
    if hazard is not None:
        return f"not started: {hazard}"
    with _LOCK:
        kept = _KEPT.get(id(draft))
        if kept is not None and kept.draft() is draft:
            return status(draft) or "starting"
        _KEPT[id(draft)] = _Kept(draft)
    return "starting in the background for the next generate() calls"


def wait(draft, timeout_s: float = 600.0) -> str | None:
    """Block until `draft`'s kept process (if one was asked for) is up or has failed; returns its status."""
    kept = _KEPT.get(id(draft))
    if kept is not None:
        kept.thread.join(timeout_s)
    return status(draft)


def kept(draft, timeout_s: float = 600.0):
    """For an explicit `ssd_worker="process"`: `draft`'s kept process, started (and waited for) now if need be, so
    that only the first such call pays the start-up. None when it cannot be kept here (see `spawn_hazard`) or
    another thread's generation is using it: the call then starts a process of its own, as without a pool."""
    if ready(draft) is None and start(draft).startswith("starting"):
        wait(draft, timeout_s)
    return ready(draft)


@atexit.register
def close_all() -> None:
    """End every kept process (also run at interpreter exit)."""
    with _LOCK:
        kept = list(_KEPT.values())
        _KEPT.clear()
    for k in kept:
        k.thread.join(30)
        if k.process is not None:
            k.process.close()


# ---- is it safe to spawn? -------------------------------------------------------------------------------------------
def spawn_hazard() -> str | None:
    """Why starting a process now could do harm, or None when it cannot."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return f"{ENV} is off"
    if multiprocessing.parent_process() is not None:
        return "this is itself a process that multiprocessing started"
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None:  # an interactive session or `python -c`: spawn does not import anything again
        return None
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return f"cannot read the main script {path} to check it runs nothing at import"
    for node in tree.body:
        if not _inert(node):
            return (f"{path} runs code at import (line {node.lineno}) outside `if __name__ == \"__main__\":`, which "
                    "a spawned process would run again; guard it, or pass ssd_worker=hf_ssd.DraftProcess(draft)")
    return None


def _inert(node: ast.stmt) -> bool:
    """Does this top-level statement only define things (no call of user code at import)?"""
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Pass)):
        return True
    if isinstance(node, ast.Expr):  # a docstring
        return isinstance(node.value, ast.Constant)
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        return node.value is None or not any(isinstance(n, ast.Call) for n in ast.walk(node.value))
    if isinstance(node, ast.If) and _is_main_guard(node.test):
        return all(_inert(n) for n in node.orelse)
    return False


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    consts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(consts) == 1
