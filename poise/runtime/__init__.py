"""Low-level facts of one worker process: process-group set-up and teardown (dist.py), step
clocks (clock.py) and keeping freed memory (memory.py). What a rank of ``poise train`` does with
them is :mod:`poise.train`."""
