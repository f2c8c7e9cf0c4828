"""The deadline step: micro-batches until the shared deadline, an exact mean over what was computed.

:class:`DeadlineRunner` holds one rank's straggler state across steps (its predictor, the
agreed rates, the pool of deferred samples, the delays to inject) and runs the parts of a
step that :class:`poise.Session`'s deadline step delegates to it:

1. **Plan** (:meth:`plan_step`): the step's lists of micro-batches (every rank's part of
   the step's batch, and the pool; :mod:`poise.straggler.plan`) and the deadline, from the
   rates all ranks agreed on at the end of the step before: no collective of its own.
2. **Micro-batches** (:meth:`micro_batches`): the rank claims one micro-batch at a time
   (:mod:`poise.straggler.claims`): from its own list, then the pool, then the other ranks'
   lists, so a rank that is ahead takes work off a delayed one within the step. Before each
   claim it checks the micro-batch would end by the deadline; the one after which the next
   would not fit, or after which the other ranks can take what is left in one round (at most
   W − 2 micro-batches unclaimed: :meth:`DeadlineRunner._few_left`), is the last, reduced by
   DDP during its backward (overlap kept). A rank that finds nothing left to claim before
   its last one was armed, or stops before reducing (or computed nothing), enters the
   reduction with a zero backward through DDP, so every rank joins every bucket's all-reduce
   and nobody hangs.
   **The watchdog**: a rank that is not inside a forward or backward at the deadline (in an
   injected delay: a stall between micro-batches, before its first) does not hold the others
   back: a thread of its own enters the reduction for it, with the micro-batches it
   finished, at the deadline or, during a stall, once every micro-batch of the step is
   claimed (:meth:`DeadlineRunner._watch`). The rank's thread holds the
   step's lock except in those delays, so the watchdog never reads a gradient half
   accumulated; a forward or backward that runs past the deadline is waited for. The stalled
   rank steps its optimizer when it wakes and starts the next step late, with what is left
   of that step's deadline (its origin stays the others', see below). What the delays stand
   for: time a rank's training loop waits outside its forward and backward (for its input,
   for a resource it shares), which the all-reduce, run from another thread, need not wait
   for. Loading a micro-batch stays under the lock: it is claimed by then, and a claimed
   micro-batch counts as computed.
3. **The count** (:meth:`begin_reduce` / :meth:`end_reduce`): right before the last
   backward each rank starts one small asynchronous all-reduce of ``[loss terms computed,
   predicted rate, gap]`` per rank and the micro-batches it took from each list
   (4 × world + 1 numbers), issued before the gradient buckets on every rank. When
   backward returns, the gradient (each rank's sum of per-term gradients divided by the
   planned total) is rescaled by planned / computed terms: the exact mean over the terms
   actually computed, whatever the codec or collective. The same numbers give every rank the
   new pool and the next step's deadline.

Where the deadline is counted from: the end of the previous step's reduction (which every
rank leaves at nearly the same moment) plus the usual gap to the next step's start (the
optimizer step, the next batch: the smallest gap any rank had in the step before, agreed in
the count). A rank delayed after its reduction (a stall after its last micro-batch, a pause
before its next step) therefore starts late with less time left, and still reaches the next
reduction with the others; counted from its own start, it would take its whole deadline and
make every other rank wait for the delay. A rank more than half the deadline late (a
checkpoint save, the first step) counts from its own start, unless the watchdog entered its
last reduction (then it was late alone, and the others are already computing).

Why the median rank's predicted time sets the deadline, and work is claimed, not dealt: a
rank that is ahead takes the pool's and a delayed rank's micro-batches until the deadline,
so the ranks that are not delayed keep computing instead of waiting; what nobody reached by
the deadline goes to the pool.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from poise.config import StragglerConfig
from poise.straggler.claims import Claims, LocalClaims
from poise.straggler.predict import make_predictor
from poise.straggler.queues import build_queues, catch_up, deadline_s, pool_after
from poise.straggler.stale import StaleStash
from poise.sync.deadline.step_state import StepPlan
from poise.sync.deadline.watchdog import start_watchdog

log = logging.getLogger(__name__)



class Pauses(Protocol):
    """Waits a rank spends outside its forward and backward, in seconds (an emulation of
    delays injects them: :mod:`poise.emulate.delays`); the runner sleeps them with the step's
    lock released, so the watchdog can enter the reduction meanwhile."""

    def before_step(self, rank: int, step: int, predicted_s: float | None) -> float: ...

    def after_micro(self, rank: int, step: int, micro: int, compute_s: float) -> float: ...

    def describe(self) -> str: ...


class NoPauses:
    """No waits: the production default."""

    def before_step(self, rank: int, step: int, predicted_s: float | None) -> float:
        return 0.0

    def after_micro(self, rank: int, step: int, micro: int, compute_s: float) -> float:
        return 0.0

    def describe(self) -> str:
        return "none"


class DeadlineRunner:
    """One rank's straggler-tolerant aggregation state (see module doc).

    Args:
        config: the straggler settings (mode, micro-batches, slack, predictor, delays).
        rank, world_size: this rank, the number of ranks.
        costs: per-sample cost (any unit: the rates are seconds per unit).
        loss_terms: per-sample loss terms (None: one per sample).
        device: where the count all-reduce's tensor lives (the process group's device).
        seed: seeds the LSTM predictor's initial weights.
        claims: how micro-batches are claimed (:func:`poise.straggler.claims.store_claims`
            for a process group; local counters, the default, are right for one rank only).
        pauses: waits outside forward and backward to sleep through (emulated delays); none by default.
    """

    def __init__(self, config: StragglerConfig, *, rank: int, world_size: int, costs: np.ndarray,
                 loss_terms: np.ndarray | None, device: torch.device, seed: int = 0,
                 claims: Claims | None = None, pauses: Pauses | None = None) -> None:
        if claims is None and world_size > 1:
            raise ValueError(f"DeadlineRunner for {world_size} ranks needs claims shared by them "
                             "(poise.straggler.claims.store_claims)")
        self.claims = claims if claims is not None else LocalClaims()
        self.config, self.rank, self.world_size = config, rank, world_size
        self.costs = np.asarray(costs, dtype=np.float64)
        self.loss_terms = loss_terms
        self.device = device
        self.pauses: Pauses = pauses if pauses is not None else NoPauses()
        self.predictor = make_predictor(config.predictor, seed=seed * 1000 + rank)
        self.rates = np.full(world_size, math.nan)  # agreed at the end of each step: s per cost unit
        self.pool = np.zeros(0, dtype=np.int64)
        self.micro_samples = 0  # samples per planned micro-batch (the pool is claimed in such chunks)
        self.stash = StaleStash(config.max_staleness) if config.mode == "deadline+stale" else None
        self.micro_planned = 0  # micro-batches of the sampler's plans (this rank), for the report
        self.micro_deferred = 0  # of those, not reached in their own step
        self.micro_taken_over = 0  # micro-batches this rank took from other ranks' lists
        self.stale_steps = 0
        self.late_joins = 0  # reductions the watchdog entered for this rank while it stalled
        self.early_joins = 0  # of those, before the deadline (every micro-batch claimed)
        # every micro-batch's observed rate (s per cost unit, stalls included) and its compute
        # alone: what the predictors are scored on (poise bench stragglers)
        self.trace: list[tuple[float, float]] = []
        self._wait_for_all = False  # the step before computed nothing anywhere: no deadline now
        self._observed_steps = 0  # steps finished (the first one's micro-batches are not observed)
        self._settled_s: float | None = None  # perf_counter() when the last reduction ended here
        self._usual_gap_s: float | None = None  # agreed: the smallest gap of any rank in the last step
        self._joined_late = False  # the watchdog entered the last step's reduction for this rank
        self._lock = threading.Lock()  # held by the rank's thread except in injected delays (see _stall)

    # -- plan ------------------------------------------------------------------------------

    def terms_of(self, indices: np.ndarray) -> float:
        return float(self.loss_terms[indices].sum()) if self.loss_terms is not None else float(len(indices))

    def plan_step(self, index: int, batches: list[np.ndarray] | None) -> StepPlan:
        """The step's queues and deadline. ``batches``: every rank's batch of the sampler's step;
        None for a catch-up step (the epoch's plan is done, the pool is left)."""
        m = self.config.micro_batches
        pool = self.pool
        if batches is None:
            batches, pool = catch_up(self.pool, self.world_size, m, self.micro_samples)
        elif self.micro_samples == 0:
            self.micro_samples = max(1, int(np.ceil(np.median([len(b) for b in batches]) / m)))
        queues = build_queues(batches, pool, m, self.micro_samples)
        planned_costs = np.array([float(self.costs[b].sum()) for b in batches])
        waits = self._wait_for_all or not self.config.enabled
        deadline = None if waits else deadline_s(self.rates, planned_costs, self.config.slack)
        reference = sum(self.terms_of(b) for b in batches) or 1.0
        if index >= 2:  # every rank left step index - 2 before the last step's reduction ended
            self.claims.forget(index - 2)
        return StepPlan(index=index, queues=queues, deadline_s=deadline, reference=reference,
                        taken=np.zeros(len(queues.micro), dtype=np.int64))

    # -- micro-batches ---------------------------------------------------------------------

    def _predict_s(self, indices: np.ndarray) -> float:
        return self._predict_cost_s(float(self.costs[indices].sum()))

    def _predict_cost_s(self, cost: float) -> float:
        """Predicted seconds for ``cost`` units of work: at this rank's predicted rate, or,
        before it has one, the median rank's agreed rate (0 when nobody has one)."""
        rate = self.predictor.predict()
        if rate is None:
            known = self.rates[np.isfinite(self.rates)]
            rate = float(np.median(known)) if len(known) else 0.0
        return rate * cost

    def micro_batches(self, plan: StepPlan, load: Callable[[np.ndarray], Any],
                      arm: Callable[[bool], None], zero_reduce: Callable[[], None]) -> Generator[Any, None, None]:
        """This rank's micro-batches of ``plan`` until the deadline, loaded by ``load(indices)``.

        ``arm(last)`` is called before each is handed out (last: its backward reduces);
        ``zero_reduce()`` joins the reduction when the rank stops without a reducing backward.
        The caller runs one ``backward`` per micro-batch handed out. Close the generator when
        leaving its loop early (:class:`poise.step.DeadlineStep` does): it holds the step's lock.
        """
        queues = plan.queues
        own = queues.micro[self.rank]
        mark = plan.started_s
        limit = plan.deadline_s
        origin = self._origin_s(plan)
        watch = None
        if limit is not None and self.world_size > 1:
            watch = start_watchdog(plan, origin + limit, lock=self._lock, claims=self.claims, device=self.device,
                                   join=lambda early: self._join_late(plan, early, arm, zero_reduce))
        self._lock.acquire()
        try:
            self._stall(plan, self.pauses.before_step(self.rank, plan.index, self._predict_s(np.concatenate(own))
                                                     if own and self.predictor.predict() is not None else None))
            # off (delays injected into plain DDP): every rank computes its own share, nothing else
            order = queues.order(self.rank) if self.config.enabled else [self.rank]
            lists = [q for q in order if queues.micro[q]]
            typical = {q: float(np.mean([self.costs[mb].sum() for mb in queues.micro[q]])) for q in lists}
            while lists and not plan.reduced:
                q = lists[0]
                elapsed = time.perf_counter() - origin
                if limit is not None and elapsed + self._predict_cost_s(typical[q]) > limit:
                    break  # claim nothing that would end after the deadline: the rest goes to the pool
                i = self.claims.claim(plan.index, q)
                if i >= len(queues.micro[q]):
                    lists.pop(0)  # nothing left in this list
                    continue
                indices = queues.micro[q][i]
                plan.taken[q] += 1
                self.micro_taken_over += q not in (self.rank, self.world_size)
                need = self._predict_s(indices)
                # The last micro-batch reduces during its own backward: the next would end after the
                # deadline, or the other ranks can take what is left in one round (see _few_left).
                plan.last = ((limit is not None and elapsed + need + self._predict_cost_s(typical[q]) > limit)
                             or self._few_left(plan, lists, i))
                arm(plan.last)
                plan.current = indices
                batch = load(indices)
                began, began_cpu = time.perf_counter(), time.thread_time()
                try:
                    yield batch
                except GeneratorExit:  # the caller left its loop: count what its backward added
                    if plan.backwards == plan.computed + 1:
                        self._computed(plan, indices)
                    raise
                finally:
                    plan.compute_cpu_s += time.thread_time() - began_cpu
                    plan.compute_wall_s += time.perf_counter() - began
                if plan.backwards != plan.computed + 1:
                    raise ValueError(f"step {plan.index}: micro-batch {plan.computed} was handed out but no "
                                     "step.backward(loss) ran for it: one backward per micro-batch")
                compute_s = time.perf_counter() - began
                self._computed(plan, indices)  # before the stall: the watchdog may reduce it meanwhile
                self._stall(plan, self.pauses.after_micro(self.rank, plan.index, plan.computed - 1, compute_s))
                now = time.perf_counter()
                cost = float(self.costs[indices].sum())
                # Not observed: the last micro-batch (its backward waits for the reduction, hence for
                # the other ranks) and the run's first step (first forward and backward, bucket set-up).
                if cost > 0 and not plan.last and self._observed_steps:
                    self.predictor.update((now - mark) / cost)
                    self.trace.append(((now - mark) / cost, compute_s / cost))
                mark = now
                if plan.last:
                    break
            if not plan.reduced:
                self._join(plan, arm, zero_reduce)
        finally:
            self._lock.release()
            plan.done = True
            plan.wake.set()
            if watch is not None:
                watch.join()
        if plan.error is not None:
            raise plan.error
        if not plan.reduced:
            raise RuntimeError(f"step {plan.index}: the deadline step ended without its reduction")

    def _computed(self, plan: StepPlan, indices: np.ndarray) -> None:
        """Count the micro-batch handed out, whose backward ran: its gradient is accumulated."""
        plan.computed += 1
        plan.terms += self.terms_of(indices)
        plan.mine.append(indices)
        plan.current = None

    def _join(self, plan: StepPlan, arm: Callable[[bool], None], zero_reduce: Callable[[], None]) -> None:
        """Enter the reduction without a reducing backward of a micro-batch (with the step's lock
        held): the stash in its place under ``deadline+stale`` when this rank computed nothing."""
        if self.stash is not None and plan.computed == 0 and self.stash.usable(plan.index):
            plan.terms = self.stash.begin_replay(plan.reference)
            plan.stale = True
            self.stale_steps += 1
        arm(True)
        zero_reduce()

    def _join_late(self, plan: StepPlan, early: bool, arm: Callable[[bool], None],
                   zero_reduce: Callable[[], None]) -> None:
        """The watchdog's entry into the reduction for this rank while it stalls (lock held)."""
        self._join(plan, arm, zero_reduce)
        plan.joined_late = True
        self.late_joins += 1
        self.early_joins += early

    def _stall(self, plan: StepPlan, seconds: float) -> None:
        """An injected delay: a sleep with the step's lock released, so the watchdog can enter
        the reduction meanwhile (the delay stands for time this rank waits outside its forward
        and backward; see module doc)."""
        if seconds <= 0:
            return
        plan.stalling = True
        plan.wake.set()
        self._lock.release()
        try:
            time.sleep(seconds)
        finally:
            self._lock.acquire()
            plan.stalling = False
        plan.stall_s += seconds

    def _few_left(self, plan: StepPlan, lists: list[int], i: int) -> bool:
        """Whether at most ``spare`` micro-batches are left unclaimed in every list once this
        rank took micro-batch ``i`` of ``lists[0]`` (its lists in claiming order, the exhausted
        ones gone): then this micro-batch is its last and reduces during its own backward.

        Why ``spare = W − 2`` and not 0: the other W − 1 ranks each claim once more when they
        finish their current micro-batch, so they take W − 2 in one round even with one of them
        stalled. Ending here puts a stall that follows this micro-batch after the reduction, where
        it delays this rank's next start (absorbed by the deadline's origin, see module doc),
        instead of before it, where every rank would wait for it. At 2 ranks, and with deadline
        steps off (a rank computes its own share only), ``spare`` is 0. The cost: a store read
        per list left, and only once the current list has ``spare`` or fewer left; a rank may
        wait at the reduction for up to one micro-batch of the others' instead of computing it.
        """
        spare = max(0, self.world_size - 2) if self.config.enabled else 0
        left = len(plan.queues.micro[lists[0]]) - 1 - i
        for r in lists[1:]:
            if left > spare:
                return False
            left += max(0, len(plan.queues.micro[r]) - self.claims.claimed(plan.index, r))
        return left <= spare

    def _origin_s(self, plan: StepPlan) -> float:
        """Where ``plan``'s deadline counts from (perf_counter seconds; see module doc)."""
        if self._settled_s is not None:
            plan.gap_s = max(0.0, plan.started_s - self._settled_s)
        if plan.deadline_s is None or self._settled_s is None or self._usual_gap_s is None:
            return plan.started_s
        anchor = self._settled_s + self._usual_gap_s
        if plan.started_s - anchor > 0.5 * plan.deadline_s and not self._joined_late:
            return plan.started_s
        return min(anchor, plan.started_s)

    # -- the count -------------------------------------------------------------------------

    def begin_reduce(self, plan: StepPlan, micro: np.ndarray | None) -> None:
        """Start the count all-reduce, right before the backward that reduces the gradient.
        ``micro``: the micro-batch whose backward this is (None: the zero backward)."""
        if plan.reduced:
            raise RuntimeError(f"step {plan.index}: a second reducing backward in one deadline step")
        w = self.world_size
        vector = torch.zeros(4 * w + 1, dtype=torch.float64, device=self.device)
        own_rate = self.predictor.predict()
        vector[self.rank] = plan.terms + (self.terms_of(micro) if micro is not None else 0.0)
        vector[w + self.rank] = own_rate if own_rate is not None else 0.0
        vector[2 * w + self.rank] = plan.gap_s
        vector[3 * w:] = torch.from_numpy(plan.taken.astype(np.float64))  # summed: each list's taken
        plan.vector, plan.reduced = vector, True
        plan.work = dist.all_reduce(vector, async_op=True)

    def end_reduce(self, plan: StepPlan, model: DistributedDataParallel) -> None:
        """After the reducing backward: the exact mean over computed terms, and the agreed numbers."""
        assert plan.work is not None and plan.vector is not None
        plan.work.wait()
        values = plan.vector.cpu().numpy()
        w = self.world_size
        plan.total_terms = float(values[:w].sum())
        rates = values[w:2 * w]
        self.rates = np.where(rates > 0, rates, math.nan)
        gaps = values[2 * w:3 * w]
        plan.taken_all = np.rint(values[3 * w:]).astype(np.int64)
        self._usual_gap_s = float(gaps.min()) if np.all(gaps >= 0) else None
        self._settled_s = time.perf_counter()
        plan.settled = True
        if plan.total_terms > 0 and plan.total_terms != plan.reference:
            scale = plan.reference / plan.total_terms
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(scale)

    def finish_step(self, plan: StepPlan, sampler_step: bool) -> np.ndarray:
        """Close ``plan``: the new pool (what nobody reached goes back), the stash; returns the
        sample indices this rank trained in the step."""
        queues = plan.queues
        # a stale rank took nothing: its taken entries are 0, as the other ranks learnt too
        self.pool = pool_after(queues, plan.taken_all)
        self._wait_for_all = plan.total_terms == 0
        self._joined_late = plan.joined_late
        self._observed_steps += 1
        if sampler_step:
            planned = queues.planned[self.rank]
            self.micro_planned += planned
            self.micro_deferred += max(0, planned - int(plan.taken_all[self.rank]))
        if self.stash is not None:
            self.stash.kept(plan.index, plan.terms, plan.reference)
        return np.concatenate(plan.mine) if plan.mine else np.zeros(0, dtype=np.int64)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """What every rank shares: the pool, the agreed rates, the pool's chunk size."""
        return {"pool": self.pool.tolist(), "rates": [None if math.isnan(r) else float(r) for r in self.rates],
                "micro_samples": self.micro_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pool = np.asarray(state.get("pool", []), dtype=np.int64)
        if pool.ndim != 1 or (len(pool) and (pool.min() < 0 or pool.max() >= len(self.costs))):
            raise ValueError(f"straggler state: the pool holds indices outside 0..{len(self.costs) - 1}")
        self.pool = pool
        self.micro_samples = int(state.get("micro_samples", 0))
        rates = state.get("rates") or []
        if len(rates) == self.world_size:
            self.rates = np.array([math.nan if r is None else float(r) for r in rates])

    def summary(self) -> dict[str, Any]:
        """Figures for the report: micro-batches deferred, stale steps, the delay model."""
        return {"mode": self.config.mode, "micro_batches": self.config.micro_batches, "slack": self.config.slack,
                "predictor": self.config.predictor, "delay": self.pauses.describe(),
                "micro_planned": self.micro_planned, "micro_deferred": self.micro_deferred,
                "micro_taken_over": self.micro_taken_over,
                "stale_steps": self.stale_steps, "pool_left": len(self.pool),
                "late_joins": self.late_joins, "early_joins": self.early_joins,
                "trace": [[round(a, 9), round(b, 9)] for a, b in self.trace]}


__all__ = ["DeadlineRunner", "NoPauses", "Pauses", "StepPlan"]
