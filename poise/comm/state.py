"""What every comm hook's state offers its caller: the :class:`CommState` protocol and its counters.

The training step, the checkpoint code and the resume workaround (``settle.py``) talk to a
hook's state only through :class:`CommState`, whichever hook it is: poise's
(:class:`~poise.comm.adapter.HookState`) or the adapter around torch's own hooks
(:class:`~poise.comm.torch_hooks.TorchHookState`). :class:`CountingState` is the part both
share: the byte and second counters (:class:`Counters`, read as :class:`StepStats`), the
weight of the next reductions and the bypass switch.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from poise.comm.trial import CodecTrial


@dataclass(frozen=True)
class StepStats:
    """Communication counters of one rank over one step (since the last reset).

    Attributes:
        raw_bytes: gradient bytes handed to the reducers.
        wire_bytes: bytes this rank put into collectives (its own payloads, padding included).
        encode_s: seconds spent encoding, on the calling (autograd) thread.
        decode_s: seconds spent decoding, in future callbacks.
        buckets: number of buckets reduced.
    """

    raw_bytes: int = 0
    wire_bytes: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    buckets: int = 0

    @property
    def compression_ratio(self) -> float:
        """raw_bytes / wire_bytes (1.0 when nothing was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0


class Counters:
    """Accumulates :class:`StepStats`; safe to update from callback threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = StepStats()

    def add(self, *, raw_bytes: int = 0, wire_bytes: int = 0, encode_s: float = 0.0, decode_s: float = 0.0,
            buckets: int = 0) -> None:
        with self._lock:
            s = self._stats
            self._stats = StepStats(s.raw_bytes + raw_bytes, s.wire_bytes + wire_bytes, s.encode_s + encode_s,
                                    s.decode_s + decode_s, s.buckets + buckets)

    def snapshot(self) -> StepStats:
        with self._lock:
            return self._stats

    def reset(self) -> None:
        with self._lock:
            self._stats = StepStats()


@runtime_checkable
class CommState(Protocol):
    """The state of a registered comm hook, as the training loop and checkpoints use it.

    Attributes:
        weight: this rank's factor for the next reductions; None averages like DDP. Set it to
            the rank's share ``w_r`` to get ``sum_r w_r g_r``. torch's hooks only average:
            theirs refuses a weight with a ValueError when the next bucket arrives.
        trial: ``comm.codec=auto``'s decision (``poise/comm/trial.py``); None for other codecs.
    """

    weight: float | None
    trial: CodecTrial | None

    def reset_step(self) -> None:
        """Zero the counters; call before each step's ``backward()``."""

    def step_stats(self) -> StepStats:
        """This rank's bytes and seconds since :meth:`reset_step` (read after ``backward()``)."""

    def inter_node_stats(self) -> StepStats:
        """This rank's compressed traffic between nodes since :meth:`reset_step` (leaders of a
        hierarchical reduction with a codec; zero everywhere else)."""

    def bypassed(self) -> contextlib.AbstractContextManager[None]:
        """While inside, the hook sends every bucket with a plain averaging all-reduce, counts
        no step and touches no codec state (``settle.settle_buckets`` uses it)."""

    def between_steps(self) -> bool:
        """Work the hook does outside any step, on every rank, after each step (``comm.codec=auto``'s
        dry runs: ``poise/comm/trial.py``); True if it ran anything, whose seconds are then no
        step's."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (step count, residuals, warm starts); no process group."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def shared_state_dict(self) -> dict[str, Any]:
        """The part of :meth:`state_dict` every rank holds alike (the step count, which says
        whether compression has started): a checkpoint written by one rank restores it on all."""

    def load_shared_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`shared_state_dict` (this rank's own residuals start fresh)."""


class CountingState:
    """The :class:`CommState` members that do not depend on the hook: counters, weight, bypass.

    Attributes:
        weight: see :class:`CommState`.
        counters: every byte this rank hands to collectives (:meth:`step_stats`); the
            reducers add to it, so pass the reducers' own (a fresh one if None).
        inter_node_counters: the compressed bytes leaders send between nodes
            (:meth:`inter_node_stats`); likewise.
    """

    def __init__(self, counters: Counters | None = None, inter_node_counters: Counters | None = None) -> None:
        self.weight: float | None = None
        self.trial: CodecTrial | None = None
        self.counters = counters if counters is not None else Counters()
        self.inter_node_counters = inter_node_counters if inter_node_counters is not None else Counters()
        self._bypass = False

    @property
    def bypassing(self) -> bool:
        """Whether the hook is inside :meth:`bypassed`."""
        return self._bypass

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        self._bypass = True
        try:
            yield
        finally:
            self._bypass = False

    def between_steps(self) -> bool:
        return False

    def step_stats(self) -> StepStats:
        return self.counters.snapshot()

    def inter_node_stats(self) -> StepStats:
        return self.inter_node_counters.snapshot()

    def reset_step(self) -> None:
        self.counters.reset()
        self.inter_node_counters.reset()
