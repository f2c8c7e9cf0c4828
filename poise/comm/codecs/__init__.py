"""Gradient codecs: encode a flat gradient into payload tensors and decode it back.

``CODECS`` is the one table from a codec name (the class's ``name``) to its class; :func:`make`
is the lookup. ``poise/comm/registry.py`` offers every codec here as a ``comm.codec`` name, with
the properties the class declares (``lossy``, ``freezes_variance``, ``checkpoint_delta``: see
``base.py``). Every codec has ``encode(tensor, key=None) -> Encoded``,
``decode(encoded, out=None) -> tensor`` (same shape and dtype as the input),
``nbytes(encoded) -> int`` (bytes on the wire) and ``summable``. See ``base.py`` for the
contract and each module for its algorithm and paper.

Options, by codec: ``ratio`` (topk, randomk: share of entries sent, in (0, 1]); ``exact``
(topk); ``rank`` (powersgd); ``chunk_size`` and ``rounding`` (int8); ``seed`` (randomk,
powersgd, int8).
"""

from __future__ import annotations

from typing import Any

from poise.comm.codecs.base import Codec, Encoded
from poise.comm.codecs.cast import Bf16Codec, Fp16Codec, IdentityCodec
from poise.comm.codecs.error_feedback import ErrorFeedback, NonFiniteGradientError
from poise.comm.codecs.int8 import Int8Codec
from poise.comm.codecs.lowrank import PowerSGDCodec
from poise.comm.codecs.randomk import RandomKCodec
from poise.comm.codecs.sign import SignCodec
from poise.comm.codecs.topk import TopKCodec

CODECS: dict[str, type[Codec]] = {
    cls.name: cls
    for cls in (IdentityCodec, Fp16Codec, Bf16Codec, Int8Codec, SignCodec, TopKCodec, RandomKCodec, PowerSGDCodec)
}


def make(name: str, **options: Any) -> Codec:
    """Build the codec called ``name`` with keyword ``options``.

    Raises:
        ValueError: one line, for an unknown name (listing the valid ones), an option the codec
            does not take, or a bad option value (such as a ratio outside (0, 1]).
    """
    cls = CODECS.get(name)
    if cls is None:
        raise ValueError(f"codec {name!r} is unknown: allowed are {', '.join(CODECS)}")
    try:
        return cls(**options)
    except TypeError as exc:  # an option this codec does not take
        raise ValueError(f"codec {name!r}: {exc}") from None


__all__ = ["CODECS", "Codec", "Encoded", "ErrorFeedback", "NonFiniteGradientError", "make"]
