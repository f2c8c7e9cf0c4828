"""What a rank of ``poise train`` does: the worker entry (:mod:`~poise.train.worker`, started by
torchrun), the loop (:mod:`~poise.train.loop`), the recipe it shares with ``poise pipeline``
(:mod:`~poise.train.recipe`: optimizer, learning-rate schedule, clipping; :mod:`~poise.train.optim`:
AdamW with a frozen second moment), the task's sampler (:mod:`~poise.train.data`), held-out
evaluation (:mod:`~poise.train.evaluate`), the record of trained samples
(:mod:`~poise.train.samples`) and how every worker process starts and ends (:mod:`~poise.train.entry`).
"""
