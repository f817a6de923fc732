"""What the controller has learned about one (pair, device, batch size, sampling) setting, kept for the life of the
process: round times per plan, acceptance, SSD's yield, start-up and verify ratios, compiled graphs, call lengths.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from hf_ssd.control.plan import Acceptance, Plan
from hf_ssd.control.shortlist import Shortlist
from hf_ssd.core.fanout import MissRateEstimator

OUTLIER = 4.0  # a round this many times the average is a one-off stall (a compile, a page fault), not the plan
START = 3  # the average starts at the median of the first rounds, so a first-round stall cannot seed it
CALL_WINDOW = 3  # calls whose mean round times settle a plan's price at the start of a call (Ema.settled)


class Ema:
    """Exponential moving average of round times, robust to one-off stalls: it starts at the median of its first
    START observations, and later ones above OUTLIER times the average are skipped, unless 3 come in a row (then
    the plan really got slower). `outlier=None`: no skipping (for quantities that have no stalls)."""

    def __init__(self, weight: float = 0.2, outlier: float | None = OUTLIER):
        self.weight, self.value, self.n = weight, None, 0
        self.outlier = outlier
        self.first: list[float] = []
        self.outliers = 0
        self.at = 0  # Memory.clock at the last observation
        self.calls: list[float] = []  # mean of each of the last CALL_WINDOW calls that observed it (end_call)
        self.call_sum, self.call_n = 0.0, 0

    def _add_to_call(self, x: float) -> None:
        self.call_sum += x
        self.call_n += 1

    @property
    def settled(self) -> float | None:
        """The median of the last CALL_WINDOW calls' means (with the running call's, if it observed anything), or
        the average while fewer than 2 calls are known. The average follows the last ~10 rounds, i.e. the end of
        the last call: on a machine whose speed drifts by ±30% over seconds, one call in a slow spell priced the
        eager sync SD of the overhead workload at 0.55x its speed, and it never ran again. A call-start decision
        uses this; mid-call decisions use the average, which reacts within a few rounds."""
        means = self.calls + ([self.call_sum / self.call_n] if self.call_n else [])
        return statistics.median(means[-CALL_WINDOW:]) if len(means) >= 2 else self.value

    def forget_calls(self) -> None:
        """Drop the ended calls' means (a cold first call's): the next calls' rounds set the call-start price."""
        self.calls = []

    def end_call(self, cold: bool = False) -> None:
        """The call's rounds become one call mean, unless the call was `cold` (it compiled this plan's graphs)."""
        if self.call_n and not cold:
            self.calls = [*self.calls, self.call_sum / self.call_n][-CALL_WINDOW:]
        self.call_sum, self.call_n = 0.0, 0

    def add(self, x: float, count: int = 1) -> None:
        for _ in range(count):
            self._add(x)

    def _add(self, x: float) -> None:
        if len(self.first) < START:
            self.first.append(x)
            self.value = statistics.median(self.first)
            self.n += 1
            self._add_to_call(x)
            return
        if self.outlier is not None and x > self.outlier * self.value and self.outliers < 2:
            self.outliers += 1
            return
        self.outliers = 0
        self._add_to_call(x)
        self.value = (1 - self.weight) * self.value + self.weight * x
        self.n += 1


YIELD_PRIOR_ROUNDS = 8.0  # a mode's yield starts as this many rounds that committed what the model said
YIELD_DECAY = 0.98  # per round: the yield follows the last ~50 rounds of the mode


class Yield:
    """Tokens SSD's rounds committed over the tokens the acceptance model predicted for them at the α in force when
    they were drafted: a ratio of decayed sums, starting from YIELD_PRIOR_ROUNDS rounds at ratio 1.

    A ratio, not the plan's own tokens per round: those depend on the text more than on the plan (the default pair
    commits 3.9 tokens per K=8 round on a code answer and 1.4 per K=5 round on a hard chat stretch), so a plan
    measured on a hard stretch was priced as if every call were as hard. Against the model at the α of the moment,
    most of the text's difficulty cancels, and what is left is the mode's own shortfall: an SSD round served by the
    n-gram backup after a cache miss commits fewer tokens than the primary draft would have."""

    def __init__(self):
        self.committed = self.modelled = 0.0

    def add(self, committed: float, modelled: float) -> None:
        if modelled <= 0.0 and self.modelled == 0.0:
            return  # nothing to set the prior's scale by
        if self.modelled == 0.0:
            self.committed = self.modelled = YIELD_PRIOR_ROUNDS * modelled
        self.committed = YIELD_DECAY * self.committed + committed
        self.modelled = YIELD_DECAY * self.modelled + modelled

    @property
    def ratio(self) -> float:
        return self.committed / self.modelled if self.modelled > 0 else 1.0

    def __bool__(self) -> bool:
        return self.modelled > 0


TAIL_DECAY = 0.98  # per round: the tail share follows the last ~50 rounds of a plan family


class TailShare:
    """The share of a plan family's time that does a full batch's work: 1 where the rounds of a batch's tail (rows
    that finished are dropped, so fewer rows decode) cost in proportion to their rows, less where they cost nearly a
    full round for a few rows' tokens.

    A plan is priced by its full rounds (`Memory.round_s`, tokens per row at the call's batch); each tail round adds
    `rows/batch x` the full round's time as useful, against what it took. The default pair on one core (sync K=2,
    batch 8) took 1.83 s a round for 8 rows, 1.70 s for 6, 1.50 s for 3 and 0.62 s for 1: a tail costs nearly
    full rounds, then a cheap last one. Recorded as ordinary rounds, those last rounds set the plan's round time (the
    average follows the latest rounds, and every call ends on its tail): synchronous SD at batch 16 was predicted
    34 tok/s and ran at 13. Plain decoding (transformers' loop) keeps every row to the end on padding: its share is
    the rows' tokens over its row-steps (`record_plain`)."""

    def __init__(self):
        self.useful = self.spent = 0.0
        self.tail_rounds = 0  # tail rounds recorded: a family that switched away before its calls' tails has none

    def add(self, seconds: float, rows_share: float, full_round_s: float | None) -> None:
        """A round that took `seconds` with `rows_share` of the call's rows decoding; a full round counts as all
        useful, a tail round as `rows_share x full_round_s` (skipped while there is no full round to compare)."""
        if rows_share < 1.0 and (full_round_s is None or seconds > OUTLIER * full_round_s):  # or a one-off stall
            return
        useful = seconds if rows_share >= 1.0 else min(seconds, rows_share * full_round_s)
        self.tail_rounds += rows_share < 1.0
        self.useful = TAIL_DECAY * self.useful + useful
        self.spent = TAIL_DECAY * self.spent + seconds

    @property
    def share(self) -> float:
        return self.useful / self.spent if self.spent > 0 else 1.0

    @property
    def seen(self) -> bool:
        """Has a tail round been recorded (else the share is 1 for want of a tail, not because tails are free)?"""
        return self.tail_rounds > 0


CALL_LENGTH_DECAY = 0.9  # per call: the expected length follows the last ~10 calls


class CallLength:
    """How many tokens a call generates (its longest row), for pricing a drafter's start over the tokens a call
    will really make: users give generous limits (`max_new_tokens=512` for answers of ~100 tokens), and a start
    spread over the limit looked 5x cheaper than it was.

    Lengths are treated as memoryless (exponential): the estimate is every call's tokens (those that hit their
    limit counted at it) over the calls that ended on their own (EOS, a stop string), the maximum-likelihood mean
    when some lengths are cut off. Until a call has ended on its own, lengths are unknown and the limit stands (a
    warm-up of 12 tokens says nothing of the answer's length). Memoryless also means a call that has run long is
    expected to run as long again, so mid-call the tokens left are min(limit left, the mean)."""

    def __init__(self):
        self.tokens = self.ended = 0.0

    def add(self, tokens: int, ended: bool) -> None:
        self.tokens = CALL_LENGTH_DECAY * self.tokens + tokens
        self.ended = CALL_LENGTH_DECAY * self.ended + float(ended)

    def left(self, limit_left: int) -> int:
        """Tokens per row a call still makes, expected, when its limit allows `limit_left` more."""
        if self.ended <= 0:
            return limit_left
        return min(limit_left, max(1, round(self.tokens / self.ended)))


@dataclass
class Tally:
    """Accepted drafts and rejections (rounds where a row did not accept every draft it had), summed over rows."""

    accepted: float = 0.0
    rejected: float = 0.0

    def add(self, accepted: float, rejected: float) -> None:
        self.accepted += accepted
        self.rejected += rejected

    def posterior(self, prior: float, weight: float) -> float:
        """α's posterior mean, with `prior` worth `weight` pseudo-observations."""
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)

    def capped(self, weight: float) -> Tally:
        """The same α, worth at most `weight` observations."""
        scale = min(1.0, weight / max(self.accepted + self.rejected, 1e-9))
        return Tally(self.accepted * scale, self.rejected * scale)

    def __add__(self, other: Tally) -> Tally:
        return Tally(self.accepted + other.accepted, self.rejected + other.rejected)


PRIOR_WEIGHT = 8.0  # pseudo-observations of α's prior
# The most observations one prompt (a row of a call) weighs in the α the next calls start from. A prompt's drafts
# are not independent draws of one α: the default pair accepted 0.95 along one MT-Bench answer and 0.78 along
# another. Counted per token, one easy answer took the pool from 0.72 to 0.87 and the next call started at K = 8,
# which ran 4-22% slower than K = 4 on ordinary answers (α ≈ 0.8). Within a call its own drafts count in full
# (Controller.acceptance).
CALL_EVIDENCE = 8.0
BONUS_WINDOW = 512.0  # bonus ranks (rows x rounds) the guessability follows
REFIT_ROUNDS = 8  # rounds between two fits of the guessability (Guessability.fit)


class Guessability:
    """How often the target's bonus token is among the draft's first F guesses (miss rate c·F^-r), fitted from the
    ranks SSD's rounds observed, behind the prior (r, c) of `Acceptance`. It sets the hit rate a speculation cache of
    a given budget is priced at: with the prior alone, a draft whose bonus guess was always right (α = 1) was priced
    as missing 6% of rounds at budget 8 and 1.6% at 32, and the controller chose a tree four times as wide for a
    hit rate that was 100% at either."""

    def __init__(self):
        prior = Acceptance()
        self.estimator = MissRateEstimator(prior_r=prior.r, prior_top1_miss=prior.top1_miss, window=BONUS_WINDOW)
        self._fit: tuple[float, float] | None = None
        self.unfitted = 0  # rounds added since the last fit

    def add(self, counts: list[float]) -> None:
        """counts[j]: bonus tokens of rank j (the last entry: ranks past the estimator's range)."""
        self.estimator.update_counts(counts)
        self.unfitted += 1

    @property
    def fit(self) -> tuple[float, float] | None:
        """(r, c); None: nothing observed, the prior holds. Refitted every REFIT_ROUNDS rounds, not every round: a
        weighted least-squares fit took 0.55 ms, a twentieth of a compiled SSD round at batch 1, and the window it
        fits is 512 ranks, which a few rounds barely move."""
        if self.unfitted and (self._fit is None or self.unfitted >= REFIT_ROUNDS):
            self._fit, self.unfitted = self.estimator.fit(), 0
        return self._fit


@dataclass
class Memory:
    """What the controller knows about one (pair, device, batch, sampling) setting."""

    # α per draft precision (key: the plan's int8): the default pair's int8 draft accepted ~0.1 less than its fp32
    # weights at T = 0.7 with one weight scale per matrix (~0.02 less per channel), and pooled together, the int8
    # plans' rounds priced the fp32 draft too low. `tallies` counts every draft; α rests on `pooled`, the ended
    # calls' drafts with each call's weight capped (CALL_EVIDENCE per row), and on the running call's, capped alike
    tallies: dict[bool, Tally] = field(default_factory=dict)
    pooled: dict[bool, Tally] = field(default_factory=dict)
    live: dict[bool, Tally] = field(default_factory=dict)
    live_rows: int = 1  # prompts the running call drafts for (its batch)
    alpha_rounds: int = 0  # drafting rounds (each row apart) that informed α: how much it rests on measurement
    guessability: Guessability = field(default_factory=Guessability)
    round_s: dict[Plan, Ema] = field(default_factory=dict)  # measured seconds per round, per plan that ran
    ssd_yield: Yield = field(default_factory=Yield)  # SSD's committed / modelled tokens per round
    # ... of the rows the cache served and of those a backup served after a miss (plan.Served)
    hit_yield: Yield = field(default_factory=Yield)
    miss_yield: Yield = field(default_factory=Yield)
    # measured / modelled cache misses, per SSD plan that ran and over all of them
    misses: dict[Plan, Yield] = field(default_factory=dict)
    all_misses: Yield = field(default_factory=Yield)
    tail: dict[str, TailShare] = field(default_factory=dict)  # per plan family (controller.family)
    clock: int = 0  # rounds recorded so far, every plan together: how old a measurement is
    # measured / modelled seconds of a drafter's start (its prefill and first drafts), per plan family: what a draft
    # plan costs a call before its first round (startup_ratio)
    startup: dict[str, Ema] = field(default_factory=dict)
    # seconds per round of plain steps inside our round loop (a switch mid-call): slower than transformers' own loop,
    # which plain's measured rounds are of (control.drafter)
    in_loop_plain: Ema = field(default_factory=Ema)
    # the target's prefill in seconds per prompt column, by path: "plain" (transformers' own loop, after a hand-off)
    # and "engine" (ours, rows of similar length prefilled together: runtime.prefill); a call's start in each
    # (Controller.target_prefill_s)
    prefill: dict[str, Ema] = field(default_factory=dict)
    # measured / modelled seconds of the target's verify in draft plans: how much faster the target's own forward
    # runs than its eager cost line (a compiled target), the best guide to a compiled plain step not yet measured
    verify: Ema = field(default_factory=Ema)
    # verify.value when plain was last measured: a compiled plain step's price ages with the verifies' drift since
    # then (control.calibration), not toward the verify-based model
    plain_verify: float | None = None
    # seconds of the parts of compiled rounds, as lines in their size (control.learned_line), keyed
    # ("draft", plan family, int8) for an SSD tree or a synchronous draft and ("verify", plan family)
    lines: dict = field(default_factory=dict)
    graphs: set = field(default_factory=set)  # compiled graphs the plans that ran have built (control.compiled)
    generated: float = 0.0  # tokens per row committed by the rounds recorded so far
    calls: int = 0  # generate() calls that ended in this setting
    # ... of which started on a plan run to measure it (an exploration, a second look: Decision.choice), and whether
    # the running call did: the free compiling calls count the others (control.compiled.compiling_free)
    exploring_calls: int = 0
    call_explores: bool = False
    plain_measured_call: int = -(10**9)  # `calls` when a plain call last measured α (control.exploration)
    call_length: CallLength = field(default_factory=CallLength)  # how long calls run here (the horizon's tokens)
    # plan families a call ran to measure them (control.exploration.family_exploration): each is explored once, however
    # few rounds it then recorded; `exploring` is the plan such a call runs, kept mid-call until it is measured
    explored: set = field(default_factory=set)
    exploring: Plan | None = None
    second_looks: set = field(default_factory=set)  # plans a call ran again after one cold call priced them
    stale_look_at: int = -(10**9)  # `clock` at the last look at a plan whose price had gone stale (exploration)
    untried_looks: set = field(default_factory=set)  # families whose best untried plan a call ran (untried_look)
    neighbour_looks: set = field(default_factory=set)  # plans a call ran as the K next to the choice's (neighbour_look)
    # plans that compiled graphs in the running call (here or in their draft process). Their rounds between compiles
    # still ran beside the compiler and the first runs of new graphs: in a fresh process, `ssd=True` priced SSD
    # with the process worker at 14.4 ms a round from a call that compiled for 35 s (its warm rounds took 9 ms),
    # and ran synchronous SD, 0.8x as fast, from then on
    cold: set = field(default_factory=set)
    shortlist: Shortlist | None = None  # the plans decisions predict between full evaluations (control.shortlist)
    process_shortlist: Shortlist | None = None  # ... and the process plans Controller.process_option predicts
    decide_s: float = 0.0  # what the last decision took (ControlledDrafter spaces its decisions by it)

    def record_round(self, plan: Plan, seconds: float, tokens: float | None = None, count: int = 1,
                     rounds: int | None = None) -> None:
        """`plan` took `seconds` per round (weighted as `count` observations, over `rounds` rounds of the clock,
        default `count`), its rows committing `tokens` each per round (default 1)."""
        self.clock += count if rounds is None else rounds
        self.generated += (1.0 if tokens is None else tokens) * (count if rounds is None else rounds)
        ema = self.round_s.setdefault(plan, Ema())
        ema.add(seconds, count=count)
        ema.at = self.clock

    def record_startup(self, fam: str, ratio: float) -> None:
        """A start of family `fam` took `ratio` times its model. A family's first start is left out, and later
        one-off ones far above the average (Ema's outliers) too: a start can be cold (a fresh draft process's first
        prefill: its first kernels, allocations and pages). Priced at one, every call pays it, drafting never runs
        again, and no later start corrects it: on the overhead workload a draft process's first start took 197x the
        model, its drafting plans were then charged 1.3 s of draft prefill a call, and `ssd=True` ran plain decoding
        in every later call (about 170 tok/s; with the cold start left out, the same calls ran SSD at 220-380)."""
        if fam not in self.startup:
            self.startup[fam] = Ema()
            return
        self.startup[fam].add(ratio)

    def startup_ratio(self, fam: str) -> float:
        """Measured / modelled start of plan family `fam`; a family that has not started takes the largest ratio
        measured (1 before any). Per family: a draft process prefills while the target does (Drafter.prepare), so
        its starts cost a call far less than a synchronous draft's, and pooled, they priced that one too low."""
        own = self.startup.get(fam)
        if own is not None and own.value is not None:
            return own.value
        measured = [e.value for e in self.startup.values() if e.value is not None]
        return max(measured) if measured else 1.0

    def prefill_column_s(self, path: str) -> float:
        """Seconds per padded prompt column of the target's prefill on `path` ("plain" or "engine"; our loop runs
        a call's `prefill_share` of them); 0 where it has not run."""
        e = self.prefill.get(path)
        return 0.0 if e is None or e.value is None else e.value

    def end_call(self) -> None:
        """A generate() call ended: each plan's rounds in it become one call mean (Ema.settled), except those of
        the plans that compiled graphs in it (`cold`): their call does not price them, and they may have a second
        look (control.exploration.second_look)."""
        self.calls += 1
        for int8, tally in self.live.items():
            self.pooled[int8] = self.pooled.get(int8, Tally()) + tally.capped(CALL_EVIDENCE * self.live_rows)
        self.live, self.live_rows = {}, 1
        self.exploring_calls += self.call_explores
        self.call_explores = False
        for plan, ema in self.round_s.items():
            ema.end_call(cold=plan in self.cold)
        self.second_looks -= self.cold
        self.cold = set()

    def add_acceptance(self, accepted: float, rejected: float, rounds: int = 1, int8: bool = False,
                       rows: int = 1) -> None:
        """Accepted drafts and rejections observed in the running call over `rounds` drafting rounds (or their
        equivalent), of the draft in full precision or quantized to int8 (`int8`), along `rows` prompts."""
        self.tallies.setdefault(int8, Tally()).add(accepted, rejected)
        self.live.setdefault(int8, Tally()).add(accepted, rejected)
        self.live_rows = max(self.live_rows, rows)
        self.alpha_rounds += rounds

    @property
    def accepted(self) -> float:
        return sum(t.accepted for t in self.tallies.values())

    @property
    def rejected(self) -> float:
        return sum(t.rejected for t in self.tallies.values())

    def age(self, plan: Plan) -> int:
        """Rounds recorded since `plan`'s round time was last measured."""
        return self.clock - self.round_s[plan].at

    def alpha(self, prior: float, int8: bool = False) -> float:
        """The draft's α at precision `int8`: its own rounds, behind the other precision's α as their prior (behind
        `prior`), so a precision not yet run is priced as the one that ran, and its own rounds take over."""
        other = self._evidence(not int8).posterior(prior, PRIOR_WEIGHT)
        return self._evidence(int8).posterior(other, PRIOR_WEIGHT)

    def _evidence(self, int8: bool) -> Tally:
        """What α at precision `int8` rests on: the ended calls' drafts and the running call's, each call capped."""
        live = self.live.get(int8, Tally()).capped(CALL_EVIDENCE * self.live_rows)
        return self.pooled.get(int8, Tally()) + live


_MEMORY: dict[tuple, Memory] = {}


def memory_for(key: tuple) -> Memory:
    return _MEMORY.setdefault(key, Memory())


def record_prefill(memory: Memory, path: str, seconds: float, columns: float) -> None:
    """The target's prefill of `columns` padded prompt columns took `seconds` on `path` (Memory.prefill). Our
    loop's grouped prefill counts the columns of the padded batch it stands for: the prompt width times the share
    of those tokens it ran (runtime.prefill.grouped_share)."""
    if columns > 0 and seconds > 0:
        memory.prefill.setdefault(path, Ema()).add(seconds / columns)


def record_plain(memory: Memory, step_s: float, steps: int, rows_share: float = 1.0) -> None:
    """A plain decoding run outside our round loop (transformers' own, after a hand-off) took `step_s` seconds per
    decode step over `steps` steps: its measured round time, so a plain choice is checked like any other.
    rows_share: the share of its row-steps that made tokens (transformers' loop keeps a row that ended, on padding,
    until every row has: its tail costs full steps)."""
    if steps > 0:
        memory.record_round(Plan("plain"), step_s, count=min(steps, 8), rounds=steps)
        memory.plain_verify = memory.verify.value
        memory.tail.setdefault("plain", TailShare()).add(step_s * steps, rows_share, step_s * steps)


PLAIN_TAIL_FORESEEN = "plain, foreseen"  # Memory.tail's key for plain's tail as our loop's calls foresee it
PLAIN_IN_LOOP_TAIL = "plain, in our loop"  # ... and for plain steps' tail in our loop (they drop the rows that end)


def foresee_plain_tail(memory: Memory, row_tokens: list[int]) -> None:
    """A call in our loop made `row_tokens` per row: run in transformers' loop, every row would have stepped as long
    as the longest. Answer lengths are the prompts', not the path's, so this prices plain's tail before a hand-off
    has measured it (priced at every row to the end, plain's first hand-offs at batch 4 ran at 0.65-0.95x their
    price; calibration.tail_share)."""
    longest = max(row_tokens, default=0)
    if len(row_tokens) > 1 and longest > 0:
        share = sum(row_tokens) / (len(row_tokens) * longest)
        memory.tail.setdefault(PLAIN_TAIL_FORESEEN, TailShare()).add(float(longest), share, float(longest))
