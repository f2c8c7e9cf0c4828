"""Adapters that attach :class:`poise.Session` to training frameworks.

- :mod:`poise.integrations.lightning`: ``PoiseStrategy``, a PyTorch Lightning DDP strategy, and
  ``PoiseFSDPStrategy``, the same over Lightning's FSDP2 ``ModelParallelStrategy``
  (poise's ``lightning`` extra);
- :mod:`poise.integrations.accelerate`: ``attach(accelerator, model, ...)``, a session bound
  to a Hugging Face Accelerate ``Accelerator``, on DDP or FSDP2 (poise's ``accelerate`` extra).

Nothing is imported here: importing poise never needs either framework, and importing an
adapter without its framework fails with one line naming the extra to install.
"""
