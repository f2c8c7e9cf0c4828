"""Straggler-tolerant aggregation: a shared deadline per step, nothing dropped.

- ``queues.py``: a deadline step's pure queues (each rank's micro-batches, the pool of deferred
  samples, the deadline, the epoch's catch-up steps);
- ``predict.py``: per-rank predictors of micro-batch time (median, EWMA, LSTM);
- ``delays.py``: injected delays for tests and benchmarks;
- ``stale.py``: the optional stale-gradient hook wrapper (biased, off by default);
- ``steps.py``: the deadline step that :class:`poise.Session` runs.
"""
