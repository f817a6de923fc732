"""What a plan's compiled graphs cost before its first round, when the user asked for compiled forwards.

A plan whose shapes have not been compiled in this process builds its graphs when it starts: seconds each on a
CPU (a 28-layer target's verify width: about 3 s), and minutes of them for a tree plan's five or so widths. The
first calls of a setting (COMPILE_FREE_CALLS) compile whatever plans they choose: that is the warm-up the user
opted into. After that, switching to a plan with new shapes pays its compiles out of the call that switches; the
controller charges that call a share of them, spread over the call and as many tokens again as this setting has
generated so far (a process that has run long will likely run as long again), so a plan clearly better in the long
run still gets compiled, and a call never stalls for a small gain. Calls run to measure a plan (explorations) do
not count towards the free ones (`compiling_free`).
"""
from __future__ import annotations

from hf_ssd.control.plan import MAX_K, Plan
from hf_ssd.runtime.static_choice import TARGET_K_MAX, sync_sequence_len
from hf_ssd.runtime.static_kv import static_cache_len
from hf_ssd.runtime import static_registry
from hf_ssd.runtime.static_registry import REUSE_LARGER

COMPILE_PRIOR_S = 5.0  # seconds per graph until this process has measured one
# A setting's first calls compile whatever plans they choose: the warm-up the user opted into with ssd_compile (and
# the calls a benchmark leaves untimed). Charged a share of their compiles from the first call on, the overhead
# workload's `ssd=True` kept running the first plan it had compiled (an SSD tree, or transformers' compiled plain
# loop at 0.65x our compiled SD), and later compiled the plan it should have run from the start, in a timed call
# that stalled 20 s.
COMPILE_FREE_CALLS = 6
# Calls that start on a plan run to measure it (an exploration, a second look) are not counted: they spent the free
# calls on plans the controller would not choose. At α = 1 (scripts/controller_calls.py) four of the first six calls
# explored or looked again, K = 5 was compiled at α ≈ 0.96, and K = 8, predicted 1.15x faster once α measured 0.99,
# was priced with its compile from then on and never ran. At most COMPILE_FREE_MAX_CALLS calls in all are free.
COMPILE_FREE_MAX_CALLS = 12
# transformers' compiled decode loop (a plain call on a compiled target) compiles far more than one of our
# fixed-width forwards: about 21 s against 3 s on the overhead workload. Until a hand-off has measured it, it is
# priced at this many of ours.
PLAIN_LOOP_PRIOR_GRAPHS = 5.0
_PLAIN_LOOP_S: dict[int, float] = {}  # id(target) -> measured seconds transformers' compiled loop took to compile


def compiling_free(memory) -> bool:
    """Does the setting's next call still compile for free (its warm-up, COMPILE_FREE_CALLS)?"""
    chosen = memory.calls - memory.exploring_calls
    return chosen < COMPILE_FREE_CALLS and memory.calls < COMPILE_FREE_MAX_CALLS


def record_plain_loop_compile(target, seconds: float) -> None:
    """A plain hand-off on the compiled target compiled transformers' loop in about `seconds`."""
    _PLAIN_LOOP_S[id(target)] = max(float(seconds), 0.0)


def plain_loop_built(target) -> bool:
    """Has transformers' compiled decode step been set up on `target` in this process: by a plain call of ours, or
    by the caller's own `generate(cache_implementation="static")` with a compile config? Then a plain call compiles
    nothing new (torch.compile keeps its graphs per process)."""
    return target is not None and getattr(target, "_compiled_call", None) is not None


def graph_seconds(graph: tuple, target, per_graph_s: float) -> float:
    """What building `graph` costs: our fixed-width forwards at this process's measured average, transformers'
    compiled loop at its measured time (or PLAIN_LOOP_PRIOR_GRAPHS of ours), nothing if it is built already."""
    if graph == ("plain",):
        if plain_loop_built(target):
            return 0.0
        return _PLAIN_LOOP_S.get(id(target), PLAIN_LOOP_PRIOR_GRAPHS * per_graph_s)
    return per_graph_s


def plan_graphs(plan: Plan, draft: bool, target: bool, in_loop: bool = False,
                max_length: int | None = None, prompt_len: int = 0) -> frozenset[tuple]:
    """The compiled graphs `plan` runs on: its verify width (a compiled target), its draft widths (a compiled draft:
    glue K+1, tree N and N+1, single steps; synchronous SD 1 and 2), and for plain handed off to transformers' loop,
    its compiled decode step. A process worker compiles in its own process, so its graphs are told apart; an int8
    draft runs eagerly (runtime.static_choice.compilable): no draft graph. Plain steps in our loop (`in_loop`: a
    switch mid-generation, or a call that starts plain in our loop) run the target's one-token width.

    max_length: the call's length limit. Our graphs are built per static cache, and a cache is sized for a call's
    length and the plan's tree (runtime.static_kv.static_cache_len), so each graph then also names its cache's
    slots, ("slots", M): a plan whose graphs were built on caches for short prompts compiles them again for a long
    one (`built`). Unaware of that, the controller ran an SSD plan "already compiled" on the short MT-Bench prompts
    on a HumanEval prompt, and that call compiled for 10 s."""
    if plan.mode == "plain" and not (target and in_loop):
        return frozenset({("plain",)}) if target else frozenset()

    def on(slots: int) -> tuple:
        return () if max_length is None else (("slots", slots),)

    graphs: set[tuple] = set()
    if target:
        graphs.add(("target", plan.K + 1, *on(static_cache_len(max_length or 0, TARGET_K_MAX, 0))))
    if draft and plan.mode != "plain" and not plan.int8:  # an int8 draft runs eagerly (static_choice.compilable)
        where = ("draft", plan.int8, plan.worker == "process")
        if plan.mode == "sync":  # runtime.static_choice: room for MAX_K drafts (a retune) and a hole per token
            widths: tuple[int, ...] = (1, 2)
            slots = static_cache_len(sync_sequence_len(max_length or 0, prompt_len), max(plan.K, MAX_K), 0)
        else:
            widths = (1, plan.K + 1, plan.budget) + ((plan.budget + 1,) if plan.K >= 2 else ())
            slots = static_cache_len(max_length or 0, plan.K, plan.budget)
        graphs |= {(*where, w, *on(slots)) for w in widths}
    return frozenset(graphs)


def built(graph: tuple, graphs: set) -> bool:
    """Is `graph` compiled already: itself, or the same forward on a cache that the static registry would reuse for
    it (one with at least its slots, up to REUSE_LARGER times as many)."""
    if graph in graphs:
        return True
    need = graph[-1]
    if not (isinstance(need, tuple) and need[0] == "slots"):
        return False
    return any(g[:-1] == graph[:-1] and isinstance(g[-1], tuple) and g[-1][0] == "slots"
               and need[1] <= g[-1][1] <= REUSE_LARGER * need[1] for g in graphs)


def compiled_in_process(graph: tuple, target, draft, batch: int) -> bool:
    """Is `graph` compiled in this process's static registry already, whoever built it: the controller's own record
    (Memory.graphs) knows only the plans its setting ran, and a caller's earlier `ssd_mode="sync"` calls (or a
    benchmark's hand-picked rows) compiled our target's verify widths and the full-precision draft's single steps
    on the same caches. Those were charged as if missing: on the overhead workload at batch 1 `ssd=True` never
    tried compiled sync SD on MT-Bench, the fastest row there, once its free compiling calls were spent. A draft
    process's graphs are its own and are not looked up (an int8 copy has none: it runs eagerly)."""
    slots = graph[-1][1] if isinstance(graph[-1], tuple) and graph[-1][0] == "slots" else None
    if graph[0] == "target":
        model, width = target, graph[1]
    elif graph[0] == "draft" and not graph[1] and not graph[2]:  # ("draft", int8, process, width, slots)
        model, width = draft, graph[3]
    else:
        return False
    if model is None or slots is None:
        return False
    return any(e.batch == batch and slots <= e.max_cache_len <= REUSE_LARGER * slots and width in e.compiled_widths
               for e in static_registry.registry_entries(model))


def compile_share(compile_s: float, horizon_tokens: float, generated_tokens: float) -> float:
    """Seconds of compiling (`compile_s` in all) charged to a call with `horizon_tokens` left, in a setting that
    has generated `generated_tokens` so far."""
    if compile_s <= 0 or horizon_tokens <= 0:
        return 0.0
    return compile_s * horizon_tokens / (horizon_tokens + max(generated_tokens, 0.0))
