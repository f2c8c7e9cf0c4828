"""The deadline step's watchdog: a thread that joins the reduction for a rank that stalls.

A rank that is not inside a forward or backward at the shared deadline (in an injected or
real stall between micro-batches) must not hold the others back: the watchdog enters the
reduction for it, with the micro-batches it finished, at the deadline or, during a stall,
once every micro-batch of the step is claimed (the rank would find nothing to take when it
woke). It takes the step's lock first, so it waits out a forward or backward in progress and
never reads a gradient half accumulated.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from poise.straggler.claims import Claims
from poise.sync.deadline.step_state import StepPlan

WATCH_POLL_S = 0.01  # how often a watchdog reads the claims while its rank stalls (a few store round trips)


def nothing_left(claims: Claims, plan: StepPlan, exhausted: set[int]) -> bool:
    """Whether every list of ``plan`` is claimed to its end (store reads; ``exhausted``: the
    lists already found so, which stay so)."""
    for q, micro in enumerate(plan.queues.micro):
        if q in exhausted or not micro:
            continue
        if claims.claimed(plan.index, q) < len(micro):
            return False
        exhausted.add(q)
    return True


def start_watchdog(plan: StepPlan, at_s: float, *, lock: threading.Lock, claims: Claims, device: torch.device,
                   join: Callable[[bool], None]) -> threading.Thread:
    """Start the watchdog of ``plan``: at ``at_s`` (perf_counter seconds), or during a stall once
    nothing is left to claim (checked every ``WATCH_POLL_S`` seconds), it takes ``lock`` and,
    unless the rank reduced meanwhile, calls ``join(early)`` (early: before the deadline). An
    error of ``join`` is kept in ``plan.error`` for the rank's own thread to raise."""

    def watch() -> None:
        exhausted: set[int] = set()
        early = False
        while True:
            plan.wake.clear()  # cleared before reading the state: a change after it wakes the wait
            now = time.perf_counter()
            if plan.done:
                return  # the rank left its micro-batches itself
            if now >= at_s:
                break
            if plan.stalling and nothing_left(claims, plan, exhausted):
                early = True
                break
            plan.wake.wait(min(WATCH_POLL_S, at_s - now) if plan.stalling else at_s - now)
        with lock:
            if plan.reduced:
                return
            try:
                if device.type == "cuda":
                    torch.cuda.set_device(device)  # the current device is per thread
                join(early)
            except BaseException as error:  # raised again on the rank's own thread
                plan.error = error

    thread = threading.Thread(target=watch, name=f"poise-deadline-{plan.index}", daemon=True)
    thread.start()
    return thread


__all__ = ["WATCH_POLL_S", "nothing_left", "start_watchdog"]
