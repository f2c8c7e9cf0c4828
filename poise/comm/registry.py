"""Every name ``comm.codec``, ``comm.collective`` and ``checkpoint.delta_codec`` accept, and what
poise needs to know about each: one registry per family, read from the families themselves.

- :data:`CODECS`: every poise codec of ``poise.comm.codecs.CODECS`` under its own name, with
  the properties its class declares (``lossy``, ``freezes_variance``, ``checkpoint_delta``;
  why each matters: ``poise/comm/codecs/base.py``), then ``auto`` (PowerSGD where a dry run
  says it pays, ``poise/comm/trial.py``) and torch's own hooks for comparison
  (``torch-fp16``, ``torch-powersgd``: ``poise/comm/torch_hooks.py``).
- :data:`COLLECTIVES`: every algorithm of ``poise.comm.collectives.COLLECTIVES``.

The config checks only ranges and formats; :func:`check` checks the names and the
combinations that depend on what a codec or collective is, once, where a config is resolved
(the CLI) or a run is built. Training policy that follows from a codec's properties lives
here too: :func:`freezes_variance` and :func:`compression_start`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from poise.comm import codecs, collectives, torch_hooks
from poise.comm.codecs import Codec
from poise.comm.codecs.cast import IdentityCodec
from poise.comm.codecs.lowrank import PowerSGDCodec
from poise.comm.collectives import Collective, Flat
from poise.config import CheckpointConfig, CommConfig

# checkpoint.delta_codec's name for "no codec": changed tensors are written whole
EXACT_DELTA = "exact"


@dataclass(frozen=True)
class CodecInfo:
    """What one ``comm.codec`` name is.

    Attributes:
        name: the ``comm.codec`` name.
        codec: the poise codec class it runs (``auto``: PowerSGD's); None for torch's own hooks.
        torch_hook: for torch's own hooks, the builder of ``(hook, state)`` (``torch_hooks.py``).
        lossy: an error per step of the order of the gradient: compression starts after a
            longer uncompressed warm-up (:func:`compression_start`).
        freezes_variance: with ``comm.freeze_variance=auto``, Adam's second moment is frozen
            when compression starts (:func:`freezes_variance`).
        checkpoint_delta: usable as ``checkpoint.delta_codec``.
        single_bucket_on_gloo: DDP must put every gradient in one bucket on gloo.
    """

    name: str
    codec: type[Codec] | None
    torch_hook: Callable[..., Any] | None = None
    lossy: bool = False
    freezes_variance: bool = False
    checkpoint_delta: bool = False
    single_bucket_on_gloo: bool = False

    @classmethod
    def of(cls, codec: type[Codec]) -> CodecInfo:
        """The entry of a poise codec, under its own name, with the properties it declares."""
        return cls(codec.name, codec, lossy=codec.lossy, freezes_variance=codec.freezes_variance,
                   checkpoint_delta=codec.checkpoint_delta)

    @property
    def error_feedback(self) -> bool:
        """Whether ``comm.error_feedback`` applies: a poise codec that compresses (torch's hooks
        keep their own state; ``none`` sends the gradient exactly)."""
        return self.codec is not None and self.codec is not IdentityCodec


@dataclass(frozen=True)
class CollectiveInfo:
    """What one ``comm.collective`` name is.

    Attributes:
        name: the ``comm.collective`` name.
        collective: the algorithm's class (``poise.comm.collectives``).
        local_first: ``comm.local_first`` can run over it: it never sums inside nodes first.
        torch_hooks: torch's own hooks can run over it: they call the backend's all-reduce
            themselves, so only over ``flat``, the backend's own.
    """

    name: str
    collective: type[Collective]
    local_first: bool
    torch_hooks: bool

    @classmethod
    def of(cls, collective: type[Collective]) -> CollectiveInfo:
        return cls(collective.name, collective, local_first=not collective.sums_in_nodes_first,
                   torch_hooks=collective is Flat)


CODECS: dict[str, CodecInfo] = {
    **{name: CodecInfo.of(cls) for name, cls in codecs.CODECS.items()},
    # PowerSGD once a dry run says it pays, else uncompressed: lossy as PowerSGD is
    "auto": dataclasses.replace(CodecInfo.of(PowerSGDCodec), name="auto"),
    "torch-fp16": CodecInfo("torch-fp16", None, torch_hooks.fp16),
    # torch's PowerSGD hook starts its second collective from a future callback, which hangs or
    # crashes on gloo with several buckets (tested with torch 2.13)
    "torch-powersgd": CodecInfo("torch-powersgd", None, torch_hooks.powersgd, lossy=True,
                                single_bucket_on_gloo=True),
}
COLLECTIVES: dict[str, CollectiveInfo] = {
    name: CollectiveInfo.of(cls) for name, cls in collectives.COLLECTIVES.items()
}


def codec(name: str | None) -> CodecInfo:
    """The entry of the ``comm.codec`` called ``name``. None (no codec named) reads as ``none``
    until a session decides (``poise.decide.default_codec``): what is checked before then
    (sharding, pipelines, combinations) is checked for exact gradients.

    Raises:
        ValueError: an unknown name, listing the allowed ones.
    """
    if name is None:
        return CODECS["none"]
    if name not in CODECS:
        raise ValueError(f"comm.codec={name!r} is unknown: allowed are {', '.join(CODECS)}")
    return CODECS[name]


def collective(name: str) -> CollectiveInfo:
    """The entry of the ``comm.collective`` called ``name``.

    Raises:
        ValueError: an unknown name, listing the allowed ones.
    """
    if name not in COLLECTIVES:
        raise ValueError(f"comm.collective={name!r} is unknown: allowed are {', '.join(COLLECTIVES)}")
    return COLLECTIVES[name]


def delta_codec_names() -> tuple[str, ...]:
    """What ``checkpoint.delta_codec`` accepts: ``exact``, then every codec that can write deltas."""
    return (EXACT_DELTA, *(name for name, info in CODECS.items() if info.checkpoint_delta))


def check(comm: CommConfig, checkpoint: CheckpointConfig | None = None) -> None:
    """Check the names in ``comm`` (and ``checkpoint.delta_codec``) and the combinations that
    depend on what the codec and the collective are; call once a config is resolved.

    Raises:
        ValueError: one line naming the setting and what is allowed.
    """
    info, over = codec(comm.codec), collective(comm.collective)
    if info.codec is None and not over.torch_hooks:
        raise ValueError(f"comm.collective={comm.collective!r} cannot carry torch's own hook {comm.codec!r}: "
                         "use a poise codec or comm.collective=flat")
    if comm.local_first and not (info.error_feedback and comm.error_feedback and over.local_first):
        raise ValueError(
            f"comm.local_first needs a poise codec with error feedback over a flat, ring or tree collective "
            f"(codec={comm.codec!r}, error_feedback={comm.error_feedback}, collective={comm.collective!r})"
        )
    if checkpoint is not None and checkpoint.delta_codec not in delta_codec_names():
        raise ValueError(f"checkpoint.delta_codec={checkpoint.delta_codec!r} is unknown: allowed are "
                         f"{', '.join(delta_codec_names())}")


def freezes_variance(comm: CommConfig) -> bool:
    """Whether the optimizer freezes its second moment when compression starts
    (``comm.freeze_variance`` resolved: ``auto`` follows the codec)."""
    if comm.freeze_variance == "auto":
        return codec(comm.codec).freezes_variance
    return comm.freeze_variance == "on"


def compression_start(comm: CommConfig, optimizer_steps: int, lr_warmup_steps: int) -> int:
    """Optimizer steps sent uncompressed: ``comm.start_step`` if set; else for a lossy codec (or
    a frozen variance) the larger of 5% of ``optimizer_steps`` and twice ``lr_warmup_steps``;
    else 2 (DDP rebuilds its buckets after step 1).

    Why a longer warm-up for lossy codecs: their error-feedback residuals are as large as the
    gradients, and early training, while the learning rate ramps up, is where gradients change
    fastest (torch's PowerSGD and DGC advise warm-ups too); a frozen second moment is also an
    average of the squared gradients seen by then. The measurements behind the rule are in
    ``poise/train/optim.py``.
    """
    if comm.start_step is not None:
        return comm.start_step
    if not codec(comm.codec).lossy and not freezes_variance(comm):
        return 2
    return max(2, 2 * lr_warmup_steps, math.ceil(0.05 * optimizer_steps))
