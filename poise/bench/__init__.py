"""Benchmark scenarios: each composes library pieces and real ``poise train`` jobs, never its own timers."""
