"""How gradients move: gradient codecs, error feedback, reducers, collectives and the DDP comm hook.

The stack, outermost first: the hook DDP calls per bucket (``adapter.py``) → reducer wrappers
(``wrappers.py``: local-first, hierarchical) → the codec's reducer (``reducers.py``) → the
codec (``codecs/``) and a collective that only moves bytes (``collectives/``). Every hook's
state, poise's or torch's (``torch_hooks.py``), is a :class:`CommState` (``state.py``);
``registry.py`` holds every codec and collective name with its properties, ``builder.py``
turns a ``CommConfig`` into ``(hook, state)``, and ``settle.py`` replays the bucket layout on
resume.

Compress DDP's gradients in your own training script::

    import torch
    import poise.comm
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model)                                    # after init_process_group(...)
    compress = poise.comm.hook("topk", ratio=0.01)      # error feedback is on by default
    ddp.register_comm_hook(None, compress)
    for x, y in loader:
        compress.state.reset_step()
        loss_fn(ddp(x), y).backward()                   # buckets are compressed here
        opt.step(); opt.zero_grad()
        print(compress.state.step_stats().compression_ratio)

Codecs by name: ``poise.comm.codecs.make(name, **options)`` (names in ``codecs.CODECS``).
The first ``start_step`` (2) steps run uncompressed, because DDP rebuilds its buckets after
step 1. ``poise.comm.build(config)`` does the same from a ``CommConfig``. With ``sign``
and Adam, freeze Adam's second moment when compression starts: ``poise.train.optim.AdamW``.
"""

from poise.comm import codecs
from poise.comm.adapter import HookState, hook, make_state
from poise.comm.builder import build
from poise.comm.codecs import Codec, Encoded, ErrorFeedback, NonFiniteGradientError
from poise.comm.settle import settle_buckets
from poise.comm.state import CommState, StepStats

__all__ = ["Codec", "CommState", "Encoded", "ErrorFeedback", "HookState", "NonFiniteGradientError", "StepStats",
           "build", "codecs", "hook", "make_state", "settle_buckets"]
