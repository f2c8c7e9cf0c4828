"""A session's own state for checkpoints: what :meth:`poise.Session.state_dict` holds and how
:meth:`poise.Session.load_state_dict` restores it (the public docstrings are the session's).

Kept apart from the session so the rules of a resume read in one place: a step whose backward
ran counts as done, its strategy's end included (run by the resumed session before its first
step: an outer step may be due there); the data position is shared by every rank; residuals and the
re-planner's measurements belong to one rank of one world size and are used only there.
"""

from __future__ import annotations

import logging
from typing import Any

from poise.balance.rebalance import DynamicPartitioner
from poise.balance.replay import ReplayedPartitioner
from poise.run.data import Sampler
from poise.run.record import Recorder
from poise.run.step import DeadlineStep
from poise.sync import Deadline, Sync

log = logging.getLogger(__name__)

_REQUIRED = ("rank", "world_size", "steps_done", "sampler", "comm", "comm_shared")


def session_state(*, rank: int, world_size: int, sampler: Sampler, recorder: Recorder,
                  partitioner: DynamicPartitioner | ReplayedPartitioner | None, sync: Sync,
                  deadline: Deadline | None) -> dict[str, Any]:
    """This rank's session state (see :meth:`poise.Session.state_dict`); no collective."""
    claimed = sampler.handed[0][1] if sampler.handed else sampler.position
    steps_done = recorder.steps_done
    open_step = recorder.active
    # the strategy's end of a step counted as done but not yet ended (an outer step may be due
    # there): a resume runs it before its first step, so the saved step completes as it would have
    step_end = recorder.due_end
    if open_step is not None and open_step.position >= 0:
        if open_step.backward_done:
            steps_done += 1
            if not isinstance(open_step, DeadlineStep):  # (a deadline step's reduction is in its backward)
                step_end = {**open_step.sync_end(), "rank": rank}  # its tokens are this rank's
        else:
            claimed = open_step.position
    planned = partitioner.state_dict() if partitioner else None
    window = None
    if planned is not None:
        window = planned.pop("window") + recorder.pending_window()
    return {
        "rank": rank, "world_size": world_size, "steps_done": steps_done,
        "sampler": sampler.state_dict(position=claimed),
        "partitioner": planned,
        "window": window,
        "comm": sync.state_dict(),
        "comm_shared": sync.shared_state_dict(),
        "straggler": deadline.runner.state_dict() if deadline is not None else None,
        "replicas_agree": sync.replicas_agree,
        "step_end": step_end,
    }


def load_session_state(state: dict[str, Any], *, rank: int, world_size: int, sampler: Sampler, recorder: Recorder,
                       partitioner: DynamicPartitioner | ReplayedPartitioner | None, sync: Sync,
                       deadline: Deadline | None) -> None:
    """Restore :func:`session_state` (see :meth:`poise.Session.load_state_dict`).

    Raises:
        ValueError: not a session state, or a step already ran in this process.
    """
    for key in _REQUIRED:
        if key not in state:
            raise ValueError(f"not a poise session state: {key!r} is missing (keys: {sorted(state)})")
    if recorder.clock_s is not None:  # a step opened in this process (not: a state loaded before it)
        raise ValueError(f"load_state_dict after {recorder.steps_done} steps: load before the first step")
    # loading again before the first step replaces the first load whole (a resume that falls back
    # from a checkpoint one rank could not restore to an older one): no end of its step is due
    recorder.due_end = None
    same_world = int(state["world_size"]) == world_size
    own = same_world and int(state["rank"]) == rank
    sampler.load_state_dict(state["sampler"])
    if partitioner is not None and state.get("partitioner") and same_world:
        # the shares and the re-plans are every rank's alike (they split the steps); the window
        # of measurements is the saving rank's own: another rank's starts empty
        window = state.get("window") if own else None
        partitioner.load_state_dict({**state["partitioner"], "window": window or []})
    if own:
        sync.load_state_dict(state["comm"])
    else:
        # every rank must agree on the hook's step (whether compression has started)
        sync.load_shared_state_dict(state.get("comm_shared") or {"step": 0})
        log.info("session state of rank %s of %s loaded on rank %d of %d: data position only",
                 state["rank"], state["world_size"], rank, world_size)
    if deadline is not None and state.get("straggler") and same_world:
        deadline.runner.load_state_dict(state["straggler"])
    recorder.steps_done = int(state["steps_done"]) if same_world else 0
    step_end = state.get("step_end")  # (none in an older poise's state)
    if step_end is not None and same_world:  # on every rank alike: the end may be a collective
        mine = own and int(step_end.get("rank", rank)) == rank  # (a checkpoint may share rank 0's)
        if not mine and not sync.replicas_agree:
            log.warning("session state saved inside step %s by rank %s, loaded on rank %d: the outer step due there "
                        "counts this rank's tokens of that step as 0 (save each rank's own state)",
                        step_end["index"], step_end.get("rank", state["rank"]), rank)
        recorder.due_end = {"index": int(step_end["index"]), "tokens": float(step_end["tokens"]) if mine else 0.0,
                            "optimizer_step": bool(step_end["optimizer_step"])}


__all__ = ["load_session_state", "session_state"]
