"""The composition root of one ssd=True generation: the target cache, the draft side and the engine that runs them.

The draft side is chosen in one of two ways:
- every performance option is set (mode, K, budget, worker, quantization): that plan, as given;
- otherwise the online controller (hf_ssd.control) measures the pair and picks the fastest exact plan among
  those the set options allow, and may switch plans between rounds.
Either way each plan runs behind a fallback chain of exact drafters (Saguaro -> synchronous SD -> plain steps).
"""
from __future__ import annotations

import time
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from hf_ssd.config import SSDConfig
from hf_ssd.control.controller import Controller
from hf_ssd.control.decision import Decision
from hf_ssd.control.exploration import plain_measurement
from hf_ssd.control.memory import memory_for
from hf_ssd.control.costs import measure_costs
from hf_ssd.control.drafter import ControlledDrafter, agreed, call_record
from hf_ssd.control.placement import choose_draft_device
from hf_ssd.control.plain_acceptance import PlainProbe
from hf_ssd.control.plan import MAX_K, Acceptance, Plan
from hf_ssd.core.ranks import distributed
from hf_ssd.draft.fallback import FallbackDrafter
from hf_ssd.draft.model import DraftModel
from hf_ssd.draft.protocol import Drafter
from hf_ssd.draft.quant import quantized_draft
from hf_ssd.draft.sync import NullDrafter, SyncDrafter
from hf_ssd.kernels.packed_linear import describe as packed_linear_description
from hf_ssd.runtime.engine import Engine, RowOutputs
from hf_ssd.runtime.kv import CachedModel, input_device
from hf_ssd.runtime.prefill import forward_tokens, grouped_share
from hf_ssd.runtime.processing import check_processors, with_temperature
from hf_ssd.runtime.static_choice import static_draft_cache, static_target_cache
from hf_ssd.runtime.stats import SSDStats
from hf_ssd.workers import default_worker, make_drafter, pool


def draft_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator:
    """The draft side's own RNG, seeded from the caller's, so sampling stays reproducible when it runs in a thread."""
    seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
    return torch.Generator(device=device).manual_seed(seed)


def fixed_plan(config: SSDConfig, device: torch.device) -> Plan | None:
    """The plan the options spell out completely, or None when the controller has something to choose."""
    int8 = {"int8": True, None: False}.get(config.draft_quantize)
    if config.mode == "auto" or config.num_draft_tokens is None or int8 is None:
        return None
    threads = None
    if config.target_threads is not None and config.draft_threads is not None:
        threads = (config.target_threads, config.draft_threads)
    if config.mode == "sync":
        return Plan("sync", config.num_draft_tokens, int8=int8, threads=threads)
    if config.budget is None:
        return None
    worker = config.worker if config.worker != "auto" else default_worker(device)
    return Plan("ssd", config.num_draft_tokens, config.budget, worker, int8, threads)


def constraints(config: SSDConfig, device: torch.device, worker_handle) -> dict:
    """What the set options leave the controller: {"mode": (...), "K": (...), "budget": n, "int8": b, "worker": w}."""
    allowed: dict = {}
    if config.mode != "auto":
        allowed["mode"] = (config.mode,)
    if config.num_draft_tokens is not None:
        allowed["K"] = (config.num_draft_tokens,)
    if config.budget is not None:
        allowed["budget"] = config.budget
    if config.draft_quantize != "auto" or device.type != "cpu":
        allowed["int8"] = config.draft_quantize == "int8"
    if config.worker != "auto" or worker_handle is not None:
        allowed["worker"] = "process" if worker_handle is not None else config.worker
    if config.target_threads is not None and config.draft_threads is not None:
        allowed["threads"] = (config.target_threads, config.draft_threads)
    return allowed


def run_session(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    input_ids: torch.Tensor,
    mask: torch.Tensor,
    processors: LogitsProcessorList,
    stopping: StoppingCriteriaList,
    generation_config: GenerationConfig,
    config: SSDConfig,
    generator: torch.Generator | None,
    streamer=None,
    worker=None,
    plain_hand_off: bool = False,
) -> tuple[RowOutputs | None, SSDStats]:
    """Decode with SSD (or the plan the controller picks). `plain_hand_off`: when the controller's first choice is
    plain decoding, return (None, stats) instead, so the caller runs transformers' own decoding loop, which is
    faster at plain decoding than our round loop with no drafts."""
    check_processors(processors, trust=config.trust_processors)
    if config.draft_device == "auto":
        draft.to(choose_draft_device(target, draft))
    elif config.draft_device is not None:
        from hf_ssd.hf.validate import check_draft_device

        draft.to(check_draft_device(config.draft_device))  # refused before anything moves
    B = input_ids.shape[0]
    greedy = not generation_config.do_sample
    vocab = target.config.get_text_config().vocab_size
    draft_processors = with_temperature(processors, config.draft_temperature)
    stats = SSDStats(mode=config.mode)
    d_device = input_device(draft)
    d_gen = None if greedy else draft_generator(generator, d_device)

    asked_int8 = config.draft_quantize == "int8"  # the caller's: an int8 plan of the controller's warns of nothing

    def build(plan: Plan, alpha_prior: float | None = None) -> Drafter:
        """The plan's drafter behind its exact fallback chain (`alpha_prior`: the α its fan-out starts from)."""
        model = quantized_draft(draft, "int8" if plan.int8 else None)
        K = plan.K

        def draft_model(batch: int, downweight: float, kv=None) -> DraftModel:
            return DraftModel(model, batch, vocab, draft_processors, greedy, downweight, d_gen, kv,
                              config.packed_linear)

        def ssd_drafter() -> Drafter:
            plan_config = config.updated(**plan.options(), **({} if alpha_prior is None else
                                                                  {"alpha_prior": alpha_prior}))
            max_length = generation_config.max_length
            in_process = worker is None and plan_config.worker != "process"  # a process worker builds its own
            kv = (static_draft_cache(model, plan_config, B, max_length, K, plan.budget, vocab, warn_int8=asked_int8)
                  if in_process else None)
            process = worker if worker is not None else (pooled if plan.worker == "process" and not plan.int8 else None)
            return make_drafter(plan_config, draft_model(B, config.downweight, kv), stats, plan.budget, greedy, process,
                                max_length)

        def sync_drafter() -> Drafter:
            stats.worker = "inline"
            if plan.mode != "sync":  # SSD's fallback: starts later, from the contexts (dynamic cache)
                return SyncDrafter(draft_model(0, 1.0), K, stats)
            # room for the controller's largest K, so a switch that only changes K keeps this cache (retune)
            room = max(K, MAX_K)
            kv = static_draft_cache(model, config, B, generation_config.max_length, room, 0, vocab, sync=True,
                                    prompt_len=input_ids.shape[1], warn_int8=asked_int8)
            return SyncDrafter(draft_model(B, 1.0, kv), K, stats, max_K=room if kv is not None else None)

        stats.mode = plan.mode
        if plan.mode == "plain":
            stats.worker = "inline"
            return FallbackDrafter([lambda: NullDrafter(0, input_device(target))], stats)
        chain = [ssd_drafter] if plan.mode == "ssd" else []
        chain += [sync_drafter, lambda: NullDrafter(K, input_device(target))]
        return FallbackDrafter(chain, stats)

    def plain_probe() -> PlainProbe | None:
        """Plain observes no α: where the controller asks for it, the draft reads α off the answer afterwards."""
        measuring = plain_measurement(controller, first, horizon)
        if measuring is None:
            return None
        model = quantized_draft(draft, "int8" if measuring.int8 else None)
        return PlainProbe(DraftModel(model, 0, vocab, draft_processors, greedy, 1.0, None,
                                     packed_linear=config.packed_linear),
                          controller.memory, measuring.label, int8=measuring.int8)

    threads_before = torch.get_num_threads()  # plans may set their own; the caller's setting comes back at the end
    plan = fixed_plan(config, d_device)
    # a kept draft process (workers.pool): one the controller may choose when the options leave the worker to it,
    # and the one an explicit full-precision ssd_worker="process" runs on (started at its first call)
    pooled = None
    if worker is None and config.worker == "auto" and plan is None:
        pooled = pool.ready(draft)
    elif worker is None and config.worker == "process" and config.mode != "sync" and config.draft_quantize != "int8":
        pooled = pool.kept(draft)
    wanted = None  # a process-worker plan predicted to pay: start a kept process when this generation ends
    if plan is not None:
        drafter = build(plan)
    else:
        try:
            controller = make_controller(target, draft, B, greedy, config, d_device, worker, pooled is not None,
                                         max_length=generation_config.max_length, prompt_len=input_ids.shape[1])
        except Exception as exc:  # noqa: BLE001 - measuring runs the draft; a broken draft falls back, as in the chain
            reason = f"{type(exc).__name__}: {exc}"
            stats.fallback_reason = reason
            warnings.warn(f"hf_ssd: the draft side (start-up) failed ({reason}); continuing on the exact fallback "
                          "path. Generated tokens are kept and the output distribution is unchanged.",
                          RuntimeWarning, stacklevel=2)
            drafter = build(Plan("sync", config.num_draft_tokens or 4))
        else:
            P = input_ids.shape[1]
            stats.controller_memory = controller.memory  # generate() records the call's length in it
            share = grouped_share(mask[:, :-1].bool(), forward_tokens(input_ids.device)) if P > 1 else 1.0
            stats.prefill_share = share
            horizon = controller.horizon(generation_config.max_length - P, P, share)
            first = agreed(controller.decide(horizon=horizon))
            eager = eager_call(controller, first, lambda: make_controller(
                target, draft, B, greedy, config.updated(compile=False, compile_target=False), d_device, worker,
                pooled is not None, max_length=generation_config.max_length, prompt_len=input_ids.shape[1]), horizon)
            if eager is not None:  # the compiled plans would compile: this call runs (and learns) as an eager one
                controller, first = eager
                config = config.updated(compile=False, compile_target=False)
                stats.controller_memory = controller.memory
                stats.eager_call = True
            controller.memory.call_explores = first.choice is not None  # not one of the free compiling calls
            if pooled is None and worker is None and config.worker == "auto":
                wanted = controller.process_option(first.chosen, horizon, pool.start_seconds())
            if plain_hand_off and first.plan.mode == "plain" and not first.in_loop:
                stats.mode, stats.worker = "plain", "inline"
                for name in ("per_row_accepted", "per_row_rounds", "per_row_hits", "per_row_lookups"):
                    setattr(stats, name, [0] * B)  # one entry per row, as every other plan reports
                stats.controller = call_record(controller, first, "; ran transformers' own decoding loop")
                _ask_for_process(draft, wanted, pooled, stats, first.plan)
                controller.mark_compiled(first.plan)
                stats.plain_probe = plain_probe()
                return None, stats
            if first.in_loop and greedy:  # sampled, the target's distributions would be needed, row by row
                stats.plain_probe = plain_probe()
            drafter = ControlledDrafter(controller, build, stats, first, disturbed=pool.starting,
                                        max_length=generation_config.max_length)
    try:  # from here on the drafter is closed whatever happens (it may hold a kept DraftProcess)
        target_kv = None
        if config.compile_target:
            target_kv = static_target_cache(target, B, generation_config.max_length)
        target_kv = target_kv or CachedModel(target, B, config.packed_linear)
        stats.packed_linear = (packed_linear_description(target) if isinstance(target_kv, CachedModel)
                               else "off: the target's verify runs compiled (ssd_compile_target)")
        engine = Engine(target_kv, drafter, processors, stopping, generation_config, stats, generator, streamer)
        start = time.perf_counter()
        if config.target_threads is not None:
            torch.set_num_threads(config.target_threads)
        rows = engine.run(input_ids.to(target_kv.device), mask.to(target_kv.device))
    finally:
        drafter.close()
        if target_kv is not None and hasattr(target_kv, "release"):  # static buffers back to the registry, now
            target_kv.release()
        torch.set_num_threads(threads_before)
    stats.wall_time = time.perf_counter() - start
    stats.draft_forwards = drafter.forwards
    if stats.controller is not None:
        _ask_for_process(draft, wanted, pooled, stats, getattr(drafter, "plan", None))
    return rows, stats


def eager_call(controller: Controller, first: Decision, make_eager, horizon) -> tuple[Controller, Decision] | None:
    """(the eager setting's controller, its decision) for a call of a compiled setting whose chosen plan would compile
    (control.compiled: after the setting's first calls, at a share of its compile time) where the eager setting's
    best plan is predicted faster over this call; else None. A prompt longer than the static caches built so far
    needs new graphs for every compiled plan: on the overhead workload a 1237-token prompt took 26 s where its eager
    plans run in a fraction of a second. Not under torch.distributed (every rank would have to agree)."""
    chosen = next((p for p in first.table if p.plan == first.plan), None)
    if chosen is None or chosen.parts.get("compile", 0.0) <= 0 or distributed():
        return None
    eager = make_eager()
    decision = eager.decide(horizon=horizon)
    best = next((p for p in decision.table if p.plan == decision.plan), None)
    if best is None or best.call_tokens_per_s <= chosen.call_tokens_per_s:
        return None
    decision.reason = (f"{decision.reason}; this call runs eagerly: the compiled {chosen.plan.label} would spend "
                       f"{chosen.parts['compile']:.1f} s compiling ({chosen.call_tokens_per_s:.2f} tok/s over the "
                       f"call)")
    return eager, decision


def _ask_for_process(draft, wanted, pooled, stats: SSDStats, chosen: Plan | None) -> None:
    """Record the kept process's part in ssd_stats, and start one (after the generation: see workers.pool) when the
    controller predicted a process-worker plan clearly faster than the one it ran."""
    if pooled is not None:
        stats.controller["process_worker"] = ("a kept draft process was up, so process-worker plans were candidates "
                                              "(and ran on it)")
    elif wanted is not None:
        what = pool.start(draft)
        stats.controller["process_worker"] = (
            f"{wanted.plan.label} predicted {wanted.call_tokens_per_s:.2f} tok/s over this call with its share of "
            f"the process's start ({wanted.parts.get('process_start', 0.0):.2f} s), clearly faster than "
            f"{chosen.label if chosen is not None else 'the chosen plan'}: kept draft process {what}")


def make_controller(target, draft, batch: int, greedy: bool, config: SSDConfig, device: torch.device,
                    worker_handle, process_ready: bool = False, max_length: int | None = None,
                    prompt_len: int = 0) -> Controller:
    allowed = constraints(config, device, worker_handle)
    costs = measure_costs(target, draft, batch, int8="int8" not in allowed or allowed["int8"],
                          packed=config.packed_linear is not False)
    # compiled plans cost differently from eager ones: their measured rounds are kept apart. So are the calls whose
    # options constrain the choice: what a call with every option free learns is its own (a benchmark's hand-picked
    # rows ran the plans that `ssd=True` then found measured, explored and compiled)
    key = (id(target), id(draft), str(device), batch, greedy, config.compile, config.compile_target,
           config.packed_linear, tuple(sorted(allowed.items())))
    # sampled acceptance (sum of min(p, q)) was at or above greedy's in every run of the project's benches
    # (default pair 0.73-0.80 at T = 0.7 against 0.75-0.80 greedy; overhead workload 0.78-0.81 against 0.64): a
    # lower prior for sampling made plain look faster where SD ran 1.13x plain
    prior = Acceptance(alpha=0.7)
    return Controller(costs, memory_for(key), batch, allowed, prior, fixed_alpha=config.alpha,
                      process_ready=process_ready, plain_compiled=config.compile_target,
                      draft_compiled=config.compile is not False, target=target, max_length=max_length,
                      prompt_len=prompt_len, draft=draft)
