"""Injected worker delays, for tests and benchmarks of straggler-tolerant aggregation: the
deadline strategy's pauses (``poise.sync.deadline.Pauses``).

A delay is a sleep, so a delayed rank gives its CPU away instead of burning it: on a machine
with fewer cores than workers the other ranks run faster meanwhile (``poise bench
stragglers`` says so next to its figures). Every draw comes from a generator seeded by
``(seed, rank, step, micro-batch)``, so a run's delays are the same whatever else runs, and
the delay-free run of the same seed differs only by them.

The models and how they are written (``emulate.delay``) are in ``poise/config/emulate.py``
(:class:`~poise.config.DelaySpec`, a pure parse); here are their draws.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from poise.config import DelaySpec


@dataclass(frozen=True)
class DelayModel:
    """The draws of one delay model: ``spec`` says which (see ``poise/config/emulate.py``),
    ``seed`` the run's seed. Seconds come out, from the compute seconds that go in."""

    spec: DelaySpec
    seed: int = 0

    @classmethod
    def from_spec(cls, spec: DelaySpec, *, seed: int) -> DelayModel:
        """The draws of ``spec``, seeded by the run's ``seed``."""
        return cls(spec, seed)

    def describe(self) -> str:
        """The model in words, for reports (:meth:`DelaySpec.describe`)."""
        return self.spec.describe()

    def _rng(self, rank: int, step: int, micro: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, rank, step, micro + 1])

    def before_step(self, rank: int, step: int, step_compute_s: float | None) -> float:
        """Seconds to stall before the step's first micro-batch (per-step Bernoulli only);
        ``step_compute_s``: the rank's predicted compute of the step (None: not known yet, no stall)."""
        if self.spec.name != "bernoulli" or self.spec.per != "step" or step_compute_s is None:
            return 0.0
        hit = self._rng(rank, step, -1).random() < self.spec.p
        return self.spec.x * step_compute_s if hit else 0.0

    def after_micro(self, rank: int, step: int, micro: int, compute_s: float) -> float:
        """Seconds to stall after a micro-batch that computed for ``compute_s`` seconds."""
        if self.spec.name == "slow":
            return self.spec.x * compute_s if rank == self.spec.rank else 0.0
        if self.spec.name == "bernoulli":
            if self.spec.per != "micro":
                return 0.0
            return self.spec.x * compute_s if self._rng(rank, step, micro).random() < self.spec.p else 0.0
        if self.spec.name == "lognormal":
            z = self._rng(rank, step, micro).standard_normal()
            return compute_s * self.spec.mean * math.exp(self.spec.sigma * z - self.spec.sigma**2 / 2)
        if self.spec.name == "pareto":
            lomax = self._rng(rank, step, micro).pareto(self.spec.alpha)  # mean 1 / (alpha - 1)
            return compute_s * self.spec.mean * (self.spec.alpha - 1) * lomax
        return 0.0


__all__ = ["DelayModel"]
