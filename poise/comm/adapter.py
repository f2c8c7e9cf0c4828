"""The DDP communication hook for poise's codecs: :func:`compressed_hook` and its :class:`HookState`.

:func:`compressed_hook` is the one function DDP calls per bucket. It only picks a reducer and
calls ``reduce``: the algorithm is in the reducer stack (``wrappers.compose``: local-first,
hierarchical, then the codec's own reducer in ``reducers.py`` over a collective). The first
``start_step`` steps are sent uncompressed because DDP rebuilds its buckets after step 1
(bucket indices, and with them residuals and warm starts, change meaning); torch's
``PowerSGDState`` documents the same. :func:`make_state` and :func:`hook` build the state and
a ready-to-register hook for a user's own script; ``builder.py`` does it from a config.

(This module must not use ``from __future__ import annotations``: DDP inspects the hook's
annotations at registration and compares them with real classes, not strings.)
"""

import time
from typing import Any

import torch
import torch.distributed as dist

from poise.comm import codecs
from poise.comm.codecs import Codec, ErrorFeedback
from poise.comm.codecs.cast import IdentityCodec
from poise.comm.collectives import Collective
from poise.comm.probe import CommHook
from poise.comm.reducers import AllReduceReducer, Reducer
from poise.comm.state import Counters, CountingState
from poise.comm.trial import CodecTrial, confirm_on_every_rank, decide_on_every_rank
from poise.comm.wrappers import compose


class HookState(CountingState):
    """What :func:`compressed_hook` needs across buckets and steps; a
    :class:`~poise.comm.state.CommState`.

    Attributes:
        codec: the codec, possibly wrapped in :class:`~poise.comm.ErrorFeedback` (its state is
            checkpointed; under a hierarchical reduction only leaders fill it).
        reducer: the reducer stack used from ``start_step`` on.
        uncompressed: the plain averaging all-reduce for warm-up and bypassed steps.
        start_step: steps sent uncompressed before ``reducer`` takes over.
        trial: ``comm.codec=auto``'s decision (:class:`~poise.comm.trial.CodecTrial`):
            ``reducer`` is dry-run by :meth:`between_steps` and used from ``start_step`` only if
            it pays. None: always from ``start_step``.
        step: steps seen so far (a step ends with DDP's last bucket).
        weight, counters, inter_node_counters: see :class:`~poise.comm.state.CountingState`.

    Raises:
        ValueError: ``start_step`` is negative.
    """

    def __init__(self, codec: Codec, reducer: Reducer, uncompressed: Reducer, *, start_step: int = 2,
                 counters: Counters | None = None, inter_node_counters: Counters | None = None,
                 trial: CodecTrial | None = None) -> None:
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0")
        super().__init__(counters, inter_node_counters)
        self.codec = codec
        self.reducer = reducer
        self.uncompressed = uncompressed
        self.start_step = start_step
        self.step = 0
        self.trial = trial
        self._dry_run: list[tuple[int, torch.Tensor, list[torch.Size]]] = []  # a step's buckets, kept for it
        self._dry_run_buffers: dict[int, torch.Tensor] = {}  # reused across the dry runs

    def state_dict(self) -> dict[str, Any]:
        """Step count and codec state (residuals, warm starts); no process group."""
        state: dict[str, Any] = {"step": self.step, "codec": self.codec.state_dict()}
        if self.trial is not None:
            state["trial"] = self.trial.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.codec.load_state_dict(state["codec"])
        if self.trial is not None and "trial" in state:
            self.trial.load_state_dict(state["trial"])

    @property
    def compressing(self) -> bool:
        """Whether the next step goes through ``reducer`` (past the warm-up, and kept by the trial)."""
        if self.step < self.start_step:
            return False
        return self.trial is None or self.trial.uses_codec(self.step)

    def between_steps(self) -> bool:
        """``comm.codec=auto``, after each of the trial's steps, on every rank: the codec's whole
        reduction of that step's buckets once more, timed, its result and codec state thrown away
        (``poise/comm/trial.py``), then the choice once the trial is ready; once a kept codec's
        timed steps are in, whether they confirm it. Collectives on the reducer's groups and the
        default group. Returns whether it ran anything."""
        if self.trial is not None and self.trial.confirm_ready:
            confirm_on_every_rank(self.trial, self.step)
            return True
        if self.trial is None or not self._dry_run:
            return False
        buckets, self._dry_run = self._dry_run, []
        pristine = self.codec.state_dict()  # no compressed step has run: residuals and warm starts empty
        started = time.perf_counter()
        futures = []
        for key, tensor, shapes in buckets:
            scratch = self._dry_run_buffers.get(key)
            if scratch is None or scratch.shape != tensor.shape or scratch.dtype != tensor.dtype:
                scratch = self._dry_run_buffers[key] = torch.empty_like(tensor)
            scratch.copy_(tensor)
            futures.append(self.reducer.reduce(scratch, key=key, weight=self.weight, shapes=shapes))
        torch.futures.wait_all(futures)
        self.trial.observe_dry_run(self.step - 1, time.perf_counter() - started)
        self.codec.load_state_dict(pristine)
        if self.trial.ready:
            decide_on_every_rank(self.trial)
        if self.trial.choice is not None:
            self._dry_run_buffers.clear()
        return True

    def shared_state_dict(self) -> dict[str, Any]:
        """The step count: every rank's is the same (compression starts at the same step)."""
        return {"step": self.step}

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def compressed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: reduce ``bucket`` through ``state.reducer`` (uncompressed while warming
    up or bypassed; a bypassed bucket counts no step)."""
    if state.bypassing:
        return state.uncompressed.reduce(bucket.buffer(), key=bucket.index())
    reducer = state.reducer if state.compressing else state.uncompressed
    # the parameters' shapes: low rank compresses each weight matrix of the bucket on its own
    shapes = [p.shape for p in bucket.parameters()]
    if state.trial is not None and state.trial.dry_run_due(state.step):
        state._dry_run.append((bucket.index(), bucket.buffer(), shapes))  # holds the reduced mean after the step
    fut = reducer.reduce(bucket.buffer(), key=bucket.index(), weight=state.weight, shapes=shapes)
    if bucket.is_last():
        state.step += 1
    return fut


def make_state(codec: str | Codec = "topk", *, error_feedback: bool = True, start_step: int = 2,
               on_nonfinite: str = "error", process_group: dist.ProcessGroup | None = None,
               collective: Collective | None = None, local_first: bool = False, trial: CodecTrial | None = None,
               **options: Any) -> HookState:
    """A :class:`HookState` for ``codec`` (a name from ``codecs.CODECS`` with ``options``, or
    a codec object), wrapped in error feedback unless ``error_feedback`` is False or the
    codec is ``none``, reducing through ``collective`` (None: flat); ``local_first``: see
    :class:`~poise.comm.wrappers.LocalFirst`; ``trial``: see :class:`HookState`.

    Raises:
        ValueError: options with a codec object, a bad option, or ``local_first`` without
            error feedback or over a hierarchical collective.
    """
    if isinstance(codec, str):
        codec = codecs.make(codec, **options)
    elif options:
        raise ValueError(f"options {sorted(options)} apply to codec names, not to a codec object")
    if error_feedback and not isinstance(codec, (ErrorFeedback, IdentityCodec)):
        codec = ErrorFeedback(codec, on_nonfinite=on_nonfinite)
    counters, inter_node_counters = Counters(), Counters()
    reducer = compose(codec, process_group, collective, counters, inter_node_counters, local_first=local_first)
    uncompressed = AllReduceReducer(IdentityCodec(), process_group, counters, collective)
    return HookState(codec, reducer, uncompressed, start_step=start_step, counters=counters,
                     inter_node_counters=inter_node_counters, trial=trial)


def hook(codec: str | Codec = "topk", *, error_feedback: bool = True, start_step: int = 2,
         on_nonfinite: str = "error", process_group: dist.ProcessGroup | None = None,
         collective: Collective | None = None, local_first: bool = False, **options: Any) -> CommHook:
    """A ready-to-register DDP comm hook that compresses gradients with ``codec``.

    Register it with ``ddp.register_comm_hook(None, h)``; it carries its own state as
    ``h.state`` (a :class:`HookState`: ``h.state.step_stats()``, ``h.state.weight``).
    Arguments are those of :func:`make_state`; ``options`` go to the codec (``ratio``,
    ``rank``, ``chunk_size``, ...). ``collective``: an algorithm from
    ``poise.comm.collectives.make(name)`` (None: the backend's own all-reduce).
    """
    state = make_state(codec, error_feedback=error_feedback, start_step=start_step, on_nonfinite=on_nonfinite,
                       process_group=process_group, collective=collective, local_first=local_first, **options)

    def poise_hook(_: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return compressed_hook(state, bucket)

    poise_hook.state = state  # type: ignore[attr-defined]
    return poise_hook
