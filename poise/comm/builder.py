"""From a :class:`~poise.config.CommConfig` to ``(hook, state)``.

:data:`HOOKS` maps every ``comm.codec`` name of the registry (``poise/comm/registry.py``) to a
builder: poise's codecs through ``adapter.make_state`` over the configured collective, torch's
own hooks through ``torch_hooks.py``. Names are turned into objects here, once, at the config
boundary; the worker also asks :func:`check_backend` and :func:`requires_single_bucket` before
it builds DDP.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from poise.comm import collectives, registry
from poise.comm.adapter import compressed_hook, make_state
from poise.comm.codecs import Codec
from poise.comm.codecs.int8 import Int8Codec
from poise.comm.codecs.lowrank import PowerSGDCodec
from poise.comm.codecs.randomk import RandomKCodec
from poise.comm.codecs.topk import TopKCodec
from poise.comm.probe import CommHook
from poise.comm.state import CommState
from poise.comm.topology import Topology
from poise.comm.trial import CodecTrial, earliest_start
from poise.config import CommConfig

log = logging.getLogger(__name__)

# (config, process group, topology or None, start step) -> (hook, state)
HookBuilder = Callable[[CommConfig, dist.ProcessGroup | None, Topology | None, int], tuple[CommHook, CommState]]


def _poise_codec(codec: str, **options: Callable[[CommConfig], Any]) -> HookBuilder:
    """The builder of the poise codec called ``codec`` (``auto`` runs ``powersgd``) whose options
    (codec option name -> the config field's value) come from the config."""

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
        state = make_state(codec, error_feedback=config.error_feedback, start_step=start_step,
                           on_nonfinite=config.on_nonfinite, process_group=group, collective=collective,
                           local_first=config.local_first, trial=trial,
                           **{name: read(config) for name, read in options.items()})
        log.info("comm hook: %r over %r, uncompressed for the first %d steps%s", state.codec, collective or "flat",
                 state.start_step, ", local first" if config.local_first else "")
        log.debug("comm reducer stack: %r", state.reducer)
        return compressed_hook, state

    return build_codec


# A codec's options, from the config fields that set them.
_OPTIONS: dict[type[Codec], dict[str, Callable[[CommConfig], Any]]] = {
    Int8Codec: {"chunk_size": lambda c: c.int8_chunk_size},
    TopKCodec: {"ratio": lambda c: c.topk_ratio},
    RandomKCodec: {"ratio": lambda c: c.topk_ratio},
    PowerSGDCodec: {"rank": lambda c: c.powersgd_rank},
}


def _builder(info: registry.CodecInfo) -> HookBuilder:
    """The hook builder of a registry entry: torch's own, or a poise codec's with its options."""
    if info.codec is None:
        assert info.torch_hook is not None, info
        return info.torch_hook
    return _poise_codec(info.codec.name, **_OPTIONS.get(info.codec, {}))


HOOKS: dict[str, HookBuilder] = {name: _builder(info) for name, info in registry.CODECS.items()}
_BACKENDS = ("gloo", "nccl")


def build(config: CommConfig, process_group: dist.ProcessGroup | None = None,
          topology: Topology | None = None, *, start_step: int | None = None) -> tuple[CommHook, CommState]:
    """``(hook, state)`` for ``ddp.register_comm_hook(state, hook)``, from ``config``.

    ``start_step``: steps sent uncompressed; None takes ``registry.compression_start`` without
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
    if config.codec is None:  # no codec named and none decided (a strategy built on its own): exact
        config = dataclasses.replace(config, codec="none")
    registry.check(config)
    if start_step is None:
        start_step = registry.compression_start(config, 0, 0)
    return HOOKS[config.codec](config, process_group, topology, start_step)


def requires_single_bucket(config: CommConfig) -> bool:
    """Whether DDP must put all gradients in one bucket (torch's PowerSGD hook on gloo)."""
    return registry.codec(config.codec).single_bucket_on_gloo


def check_backend(config: CommConfig, backend: str) -> None:
    """Raise a one-line ValueError if ``config.codec`` cannot run on ``backend``; call before training.

    Tested with torch 2.13 on gloo (CPU): every name in ``registry.CODECS``, bf16 and fp16 payload
    all-reduce included, and torch's fp16 hook. torch's ``bf16_compress_hook`` (not offered)
    refuses to run without CUDA and NCCL. Other backends have not been tested.
    """
    registry.codec(config.codec)  # an unknown name is an error
    if backend.lower() not in _BACKENDS:
        raise ValueError(f"comm.codec={config.codec!r} on backend {backend!r}: poise's comm hooks support "
                         f"{', '.join(_BACKENDS)}")
