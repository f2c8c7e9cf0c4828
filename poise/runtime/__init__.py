"""Low-level facts of one worker process: process-group set-up and teardown (dist.py), step
clocks (clock.py), keeping freed memory (memory.py) and whether a model is FSDP2's without
importing FSDP (fsdp.py). What a rank of ``poise train`` does with them is :mod:`poise.train`."""
