"""From a :class:`~poise.config.CommConfig` to ``(hook, state)``: the one registry of comm hooks.

:data:`HOOKS` maps every ``comm.codec`` name (``CODEC_NAMES``) to a builder: poise's codecs
through ``adapter.make_state`` over the configured collective, torch's own hooks through
``torch_hooks.py``. Names are turned into objects here, once, at the config boundary; the
worker also asks :func:`check_backend` and :func:`requires_single_bucket` before it builds DDP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from poise.comm import collectives, torch_hooks
from poise.comm.adapter import compressed_hook, make_state
from poise.comm.probe import CommHook
from poise.comm.state import CommState
from poise.comm.topology import Topology
from poise.comm.trial import CodecTrial, earliest_start
from poise.config import CODEC_NAMES, CommConfig

log = logging.getLogger(__name__)

# (config, process group, topology or None, start step) -> (hook, state)
HookBuilder = Callable[[CommConfig, dist.ProcessGroup | None, Topology | None, int], tuple[CommHook, CommState]]


def _poise_codec(codec: str | None = None, **options: Callable[[CommConfig], Any]) -> HookBuilder:
    """The builder of a poise codec (``codec``; None: the config's name) whose options (codec
    option name -> the config field's value) come from the config."""

    def build_codec(config: CommConfig, group: dist.ProcessGroup | None, topology: Topology | None,
                    start_step: int) -> tuple[CommHook, CommState]:
        collective = None
        if config.collective != "flat":
            collective = collectives.make(config.collective, group, topology=topology,
                                          segment_bytes=config.segment_bytes, small_bytes=config.tree_max_bytes)
        trial = None
        if config.codec == "auto":  # PowerSGD dry-run first (poise/comm/trial.py)
            start_step = max(start_step, earliest_start(config.auto_trial_steps))
            trial = CodecTrial(start_step, steps=config.auto_trial_steps, margin=config.auto_margin)
        state = make_state(codec or config.codec, error_feedback=config.error_feedback, start_step=start_step,
                           on_nonfinite=config.on_nonfinite, process_group=group, collective=collective,
                           local_first=config.local_first, trial=trial,
                           **{name: read(config) for name, read in options.items()})
        log.info("comm hook: %r over %r, uncompressed for the first %d steps%s", state.codec, collective or "flat",
                 state.start_step, ", local first" if config.local_first else "")
        log.debug("comm reducer stack: %r", state.reducer)
        return compressed_hook, state

    return build_codec


HOOKS: dict[str, HookBuilder] = {
    "none": _poise_codec(),
    "fp16": _poise_codec(),
    "bf16": _poise_codec(),
    "int8": _poise_codec(chunk_size=lambda c: c.int8_chunk_size),
    "sign": _poise_codec(),
    "topk": _poise_codec(ratio=lambda c: c.topk_ratio),
    "randomk": _poise_codec(ratio=lambda c: c.topk_ratio),
    "powersgd": _poise_codec(rank=lambda c: c.powersgd_rank),
    "auto": _poise_codec("powersgd", rank=lambda c: c.powersgd_rank),
    "torch-fp16": torch_hooks.fp16,
    "torch-powersgd": torch_hooks.powersgd,
}
_BACKENDS = ("gloo", "nccl")


def build(config: CommConfig, process_group: dist.ProcessGroup | None = None,
          topology: Topology | None = None, *, start_step: int | None = None) -> tuple[CommHook, CommState]:
    """``(hook, state)`` for ``ddp.register_comm_hook(state, hook)``, from ``config``.

    ``start_step``: steps sent uncompressed; None takes ``config.compression_start`` without
    a run length (callers that know it, like the training worker, pass the resolved value).

    ``config.collective`` picks the algorithm (``poise.comm.collectives``); every value but
    ``flat`` discovers the node layout and creates process groups (a collective call: every
    rank must call ``build`` at the same point), unless ``topology`` is given.

    - ``none``: the uncompressed averaging all-reduce, bit-identical to plain DDP (the same
      ``div_`` then sum that torch's ``allreduce_hook`` does), with poise's counters and weights.
    - poise codecs (fp16, bf16, int8, sign, topk, randomk, powersgd): an
      ``adapter.HookState`` with ``config.error_feedback``, ``start_step``, ``on_nonfinite``,
      ``local_first`` and the codec's option.
    - ``auto``: PowerSGD dry-run after the last ``auto_trial_steps`` uncompressed steps, used
      from ``start_step`` only if it pays (``poise/comm/trial.py``; the session times the steps
      and runs the dry runs between them).
    - ``torch-fp16``: torch's ``fp16_compress_hook``. ``torch-powersgd``: torch's
      ``powerSGD_hook`` with a ``PowerSGDState``. On gloo, torch's PowerSGD hook only works
      with a single bucket (it starts its second collective from a future callback, which
      hangs or crashes with several), so callers must build DDP with ``bucket_cap_mb`` above
      the model size: see :func:`requires_single_bucket`.

    Raises:
        ValueError: an unknown codec name (the allowed ones listed), or a bad combination.
    """
    if config.codec not in HOOKS:
        raise ValueError(f"comm.codec={config.codec!r} is unknown: allowed are {', '.join(HOOKS)}")
    if start_step is None:
        start_step = config.compression_start(0, 0)
    return HOOKS[config.codec](config, process_group, topology, start_step)


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
