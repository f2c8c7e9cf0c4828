"""The DDP communication-hook adapter for poise's codecs, and torch's own hooks beside it.

The compression adapter: :func:`compressed_hook` is the one function DDP calls per bucket; it
hands the bucket to a reducer (``reducers.py``), which runs the codec (``codecs/``) and the
collectives. :class:`HookState` holds the reducer, the step count and the counters
(:meth:`HookState.step_stats`). :func:`hook` builds one for a user's own script;
:func:`build` maps a :class:`~poise.config.CommConfig` to ``(hook, state)``, including torch's
own fp16 and PowerSGD hooks for comparison. The first ``start_step`` steps are sent
uncompressed because DDP rebuilds its buckets after step 1 (bucket indices, and with them
residuals and warm starts, change meaning); torch's ``PowerSGDState`` documents the same.

(This module must not use ``from __future__ import annotations``: DDP inspects the hook's
annotations at registration and compares them with real classes, not strings.)
"""

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from poise.comm import codecs, collectives
from poise.comm.codecs import Codec, ErrorFeedback
from poise.comm.codecs.cast import IdentityCodec
from poise.comm.collectives import Collective, Hierarchical, Topology
from poise.comm.probe import CommHook
from poise.comm.reducers import AllReduceReducer, Counters, Reducer, StepStats, make_reducer
from poise.config import CODEC_NAMES, CommConfig

log = logging.getLogger(__name__)


# -- the compression adapter -----------------------------------------------------------------


class HookState:
    """What :func:`compressed_hook` needs across buckets and steps.

    Attributes:
        codec: the codec, possibly wrapped in :class:`~poise.comm.ErrorFeedback`.
        start_step: steps sent uncompressed before the codec takes over.
        step: steps seen so far (a step ends with DDP's last bucket).
        weight: this rank's factor for the next reductions; None (default) averages like DDP.
            Set it to the rank's share ``w_r`` to get ``sum_r w_r g_r`` instead.
        collective: the all-reduce algorithm (None: flat, the backend's own). With a
            hierarchical one (or ``auto`` on several nodes, which is hierarchical there), the
            codec compresses only the inter-node step, at each node's leader: ranks sum their
            gradients uncompressed inside the node, leaders exchange encoded node sums
            (their bytes are counted in ``inter_node_counters``).
        local_first: each rank keeps the part of its own gradient that its payload did not carry
            (see :func:`compressed_hook`); needs error feedback and a flat, ring or tree collective.
    """

    def __init__(self, codec: Codec, *, process_group: dist.ProcessGroup | None = None, start_step: int = 2,
                 collective: Collective | None = None, local_first: bool = False) -> None:
        if start_step < 0:
            raise ValueError(f"start_step={start_step} must be >= 0")
        if local_first and (not isinstance(codec, ErrorFeedback) or isinstance(collective, Hierarchical)
                            or getattr(collective, "hierarchical", None) is not None):
            raise ValueError("local_first needs a codec with error feedback and a flat, ring or tree collective")
        self.codec = codec
        self.start_step = start_step
        self.local_first = local_first
        self._unsent: dict[Any, torch.Tensor] = {}  # local_first: per bucket, this step's residual change
        self.step = 0
        self.weight: float | None = None
        self.bypass = False  # see settle_buckets
        self.counters = Counters()
        self.inter_node_counters = Counters()
        self.reducer = self._reducer(codec, process_group, collective)
        self.uncompressed = AllReduceReducer(IdentityCodec(), process_group, self.counters, collective)

    def _reducer(self, codec: Codec, group: dist.ProcessGroup | None, collective: Collective | None) -> Reducer:
        hierarchical = collective if isinstance(collective, Hierarchical) else getattr(collective, "hierarchical", None)
        if hierarchical is None or isinstance(codec, IdentityCodec):
            return make_reducer(codec, group, self.counters, collective)
        topology = hierarchical.topology
        if topology.layout.num_nodes == 1:
            log.warning("comm.codec=%s has no effect: hierarchical reduction compresses only between nodes, "
                        "and this job runs on one node", codec.name)
        inter = make_reducer(codec, topology.leader_group, self.inter_node_counters) if topology.is_leader else None
        return AllReduceReducer(IdentityCodec(), group, self.counters, hierarchical.with_inter_node(inter))

    def step_stats(self) -> StepStats:
        """Bytes and seconds since the last :meth:`reset_step` (read after ``backward()``)."""
        return self.counters.snapshot()

    def inter_node_stats(self) -> StepStats:
        """This rank's compressed inter-node traffic since :meth:`reset_step` (leaders of a
        hierarchical collective with a codec; zero elsewhere)."""
        return self.inter_node_counters.snapshot()

    def reset_step(self) -> None:
        """Zero the counters; call before each step's ``backward()``."""
        self.counters.reset()
        self.inter_node_counters.reset()

    def state_dict(self) -> dict[str, Any]:
        """Step count and codec state (residuals, warm starts); no process group."""
        return {"step": self.step, "codec": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.codec.load_state_dict(state["codec"])


def compressed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: reduce ``bucket`` through ``state``'s reducer (uncompressed while warming up).

    With ``state.local_first``, each rank also adds back the part of its own (weighted)
    gradient that its payload did not carry: it applies ``g_r + sum of the others' payloads``
    instead of ``sum of all payloads``. Error feedback then delays only what the *other* ranks
    send, and nothing of a rank's own gradient. Why: with a sparsifier and error feedback, an
    entry waits until it has piled up (at 1 %, about once per hundred steps), and that delay,
    not the codec's error, is what cost top-k and random-k on the transformer (poise/optim.py).
    The residual's change over the step is exactly that unsent part: with ``c = g + e_old``
    sent as ``s`` and ``e_new = c - s``, ``g - s = e_new - e_old``. The price: ranks no longer
    hold the same weights. Rank r has applied all of its own gradient and the others' sent
    parts, so two ranks differ by the difference of their outstanding residuals. That is
    bounded as the residuals are, and a resume starts every rank from rank 0's saved weights.
    """
    if state.bypass:
        return state.uncompressed.reduce(bucket.buffer(), key=bucket.index())
    compressing = state.step >= state.start_step
    reducer = state.reducer if compressing else state.uncompressed
    # the parameters' shapes: low rank compresses each weight matrix of the bucket on its own
    shapes = [p.shape for p in bucket.parameters()]
    key = bucket.index()
    keep_own = compressing and state.local_first
    if keep_own:  # unsent := e_old (zero before the first residual), reused across steps
        unsent = state._unsent.get(key)
        if unsent is None or unsent.numel() != bucket.buffer().numel():
            unsent = state._unsent[key] = torch.empty_like(bucket.buffer().view(-1))
        before = state.codec.residual(key)
        if before is None or before.shape != unsent.shape:
            unsent.zero_()
        else:
            unsent.copy_(before)
    fut = reducer.reduce(bucket.buffer(), key=key, weight=state.weight, shapes=shapes)
    after = state.codec.residual(key) if keep_own else None
    if after is not None:  # None: the bucket went uncompressed (PowerSGD with no matrix in it)
        torch.sub(after, unsent, out=unsent)  # e_new - e_old (the future reads it before this
        # bucket's next hook call: DDP waits for every future at the end of backward)

        def add_unsent(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            out = done.value()
            out.view(-1).add_(unsent)
            return out

        fut = fut.then(add_unsent)
    if bucket.is_last():
        state.step += 1
    return fut


def make_state(codec: str | Codec = "topk", *, error_feedback: bool = True, start_step: int = 2,
               on_nonfinite: str = "error", process_group: dist.ProcessGroup | None = None,
               collective: Collective | None = None, local_first: bool = False, **options: Any) -> HookState:
    """A :class:`HookState` for ``codec`` (a name from ``codecs.CODECS`` with ``options``, or
    a codec object), wrapped in error feedback unless ``error_feedback`` is False or the
    codec is ``none``, reducing through ``collective`` (None: flat); ``local_first``: see
    :func:`compressed_hook`."""
    if isinstance(codec, str):
        codec = codecs.make(codec, **options)
    elif options:
        raise ValueError(f"options {sorted(options)} apply to codec names, not to a codec object")
    if error_feedback and not isinstance(codec, (ErrorFeedback, IdentityCodec)):
        codec = ErrorFeedback(codec, on_nonfinite=on_nonfinite)
    return HookState(codec, process_group=process_group, start_step=start_step, collective=collective,
                     local_first=local_first)


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


# -- torch's own hooks, for comparison ------------------------------------------------------


class TorchHookState:
    """Runs one of torch's hooks and counts its bytes, so it reports like :class:`HookState`.

    Wire bytes are what torch's algorithm sends (fp16: half; PowerSGD: the factors of each
    compressed matrix plus the uncompressed tensors, by PowerSGD's own size rule). Encode and
    decode seconds are not visible from outside torch's hook and stay 0. torch's hooks only
    average, so ``weight`` must stay None.
    """

    def __init__(self, torch_hook: CommHook, torch_state: Any,
                 wire_bytes: Callable[[Any, dist.GradBucket], int]) -> None:
        self.torch_hook = torch_hook
        self.torch_state = torch_state
        self.wire_bytes = wire_bytes
        self.weight: float | None = None
        self.bypass = False  # see settle_buckets
        self.counters = Counters()

    def step_stats(self) -> StepStats:
        return self.counters.snapshot()

    def reset_step(self) -> None:
        self.counters.reset()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def torch_hook_adapter(state: TorchHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: count the bucket, then run torch's hook on it."""
    if state.weight is not None:
        raise ValueError("torch's comm hooks only average: weighted reduction needs a poise codec")
    if state.bypass:
        # torch-fp16's state is the process group (None: the default one), PowerSGD's holds it
        return default_hooks.allreduce_hook(getattr(state.torch_state, "process_group", state.torch_state), bucket)
    buffer = bucket.buffer()
    state.counters.add(raw_bytes=buffer.numel() * buffer.element_size(),
                       wire_bytes=state.wire_bytes(state.torch_state, bucket), buckets=1)
    return state.torch_hook(state.torch_state, bucket)


def _fp16_wire_bytes(_: Any, bucket: dist.GradBucket) -> int:
    return bucket.buffer().numel() * 2


def _powersgd_wire_bytes(ps: powerSGD_hook.PowerSGDState, bucket: dist.GradBucket) -> int:
    """Bytes torch's ``powerSGD_hook`` sends for ``bucket`` (read before it runs)."""
    buffer = bucket.buffer()
    if ps.iter < ps.start_powerSGD_iter:
        return buffer.numel() * buffer.element_size()
    total = 0
    for grad in bucket.gradients():
        rows = grad.shape[0] if grad.dim() > 1 else 0
        cols = grad.numel() // rows if rows else 0
        rank = min(rows, cols, ps.matrix_approximation_rank)
        # torch compresses a matrix only when that at least divides its size by min_compression_rate
        if rows and (rows + cols) * rank * ps.min_compression_rate < rows * cols:
            total += (rows + cols) * rank * grad.element_size()
        else:
            total += grad.numel() * grad.element_size()
    return total


def _torch_fp16(config: CommConfig, group: dist.ProcessGroup | None,
                start_step: int) -> tuple[CommHook, TorchHookState]:
    return torch_hook_adapter, TorchHookState(default_hooks.fp16_compress_hook, group, _fp16_wire_bytes)


def _torch_powersgd(config: CommConfig, group: dist.ProcessGroup | None,
                    start_step: int) -> tuple[CommHook, TorchHookState]:
    # torch requires start_powerSGD_iter > 1 with error feedback or warm start (bucket rebuild)
    start = max(2, start_step)
    ps = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=config.powersgd_rank,
                                     start_powerSGD_iter=start, use_error_feedback=config.error_feedback,
                                     warm_start=True, random_seed=0)
    return torch_hook_adapter, TorchHookState(powerSGD_hook.powerSGD_hook, ps, _powersgd_wire_bytes)


TORCH_HOOKS: dict[str, Callable[[CommConfig, dist.ProcessGroup | None, int], tuple[CommHook, TorchHookState]]] = {
    "torch-fp16": _torch_fp16,
    "torch-powersgd": _torch_powersgd,
}

# CommConfig fields -> codec options, per codec that takes any
_CODEC_OPTIONS: dict[str, Callable[[CommConfig], dict[str, Any]]] = {
    "topk": lambda c: {"ratio": c.topk_ratio},
    "randomk": lambda c: {"ratio": c.topk_ratio},
    "powersgd": lambda c: {"rank": c.powersgd_rank},
    "int8": lambda c: {"chunk_size": c.int8_chunk_size},
}
_BACKENDS = ("gloo", "nccl")


def build(config: CommConfig, process_group: dist.ProcessGroup | None = None,
          topology: Topology | None = None, *, start_step: int | None = None) -> tuple[CommHook, Any]:
    """``(hook, state)`` for ``ddp.register_comm_hook(state, hook)``, from ``config``.

    ``start_step``: steps sent uncompressed; None takes ``config.compression_start`` without
    a run length (callers that know it, like the training worker, pass the resolved value).

    ``config.collective`` picks the algorithm (``poise.comm.collectives``); every value but
    ``flat`` discovers the node layout and creates process groups (a collective call: every
    rank must call ``build`` at the same point), unless ``topology`` is given.

    - ``none``: the uncompressed averaging all-reduce, bit-identical to plain DDP (the same
      ``div_`` then sum that torch's ``allreduce_hook`` does), with poise's counters and weights.
    - poise codecs (fp16, bf16, int8, sign, topk, randomk, powersgd): :class:`HookState` with
      ``config.error_feedback``, ``start_step``, ``on_nonfinite`` and the codec's option.
    - ``torch-fp16``: torch's ``fp16_compress_hook``. ``torch-powersgd``: torch's
      ``powerSGD_hook`` with a ``PowerSGDState``. On gloo, torch's PowerSGD hook only works
      with a single bucket (it starts its second collective from a future callback, which
      hangs or crashes with several), so callers must build DDP with ``bucket_cap_mb`` above
      the model size: see :func:`requires_single_bucket`.

    The state has ``step_stats()`` and ``reset_step()`` in every case.
    """
    if start_step is None:
        start_step = config.compression_start(0, 0)
    if config.codec in TORCH_HOOKS:
        return TORCH_HOOKS[config.codec](config, process_group, start_step)
    options = _CODEC_OPTIONS.get(config.codec, lambda _: {})(config)
    collective = None
    if config.collective != "flat":
        collective = collectives.make(config.collective, process_group, topology=topology,
                                      segment_bytes=config.segment_bytes, small_bytes=config.tree_max_bytes)
    state = make_state(config.codec, error_feedback=config.error_feedback, start_step=start_step,
                       on_nonfinite=config.on_nonfinite, process_group=process_group, collective=collective,
                       local_first=config.local_first, **options)
    log.info("comm hook: %r over %r, uncompressed for the first %d steps%s", state.codec,
             collective or "flat", state.start_step, ", local first" if state.local_first else "")
    return compressed_hook, state


def settle_buckets(ddp: torch.nn.parallel.DistributedDataParallel, state: Any,
                   forward_backward: Callable[[], None]) -> None:
    """Make DDP settle its bucket layout now, without changing any state; call on every rank.

    Why: DDP starts with buckets in reverse parameter order and, at the first forward after a
    synchronised backward, rebuilds them in the order gradients became ready. Per-bucket
    state (error-feedback residuals, PowerSGD's warm starts, random-k's counters) is keyed by
    bucket index, and a checkpoint holds it in the rebuilt layout. A resumed job starts with
    the initial layout again, so its first compressed step would apply every residual to the
    wrong entries. One throw-away ``forward_backward`` with the hook bypassed (plain
    all-reduce, no step counted, no residual touched) lets DDP record the order; the first
    real step then runs on the layout the checkpoint was written with. Gradients are cleared
    afterwards, so call it before restoring any.
    """
    state.bypass = True
    try:
        forward_backward()
    finally:
        state.bypass = False
    ddp.zero_grad(set_to_none=True)
    state.reset_step()


def requires_single_bucket(config: CommConfig) -> bool:
    """Whether DDP must put all gradients in one bucket (torch's PowerSGD hook on gloo)."""
    return config.codec == "torch-powersgd"


def check_backend(config: CommConfig, backend: str) -> None:
    """Raise a one-line ValueError if ``config.codec`` cannot run on ``backend``; call before training.

    Tested with torch 2.13 on gloo (CPU): every name in ``CODEC_NAMES``, bf16 and fp16 payload
    all-reduce included, and torch's fp16 hook. torch's ``bf16_compress_hook`` (not offered)
    refuses to run without CUDA and NCCL. Other backends have not been tested.
    """
    if config.codec not in CODEC_NAMES:
        raise ValueError(f"comm.codec={config.codec!r} is unknown: allowed are {', '.join(CODEC_NAMES)}")
    if backend.lower() not in _BACKENDS:
        raise ValueError(f"comm.codec={config.codec!r} on backend {backend!r}: poise's comm hooks support "
                         f"{', '.join(_BACKENDS)}")
