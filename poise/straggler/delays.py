"""Injected worker delays, for tests and benchmarks of straggler-tolerant aggregation.

A delay is a sleep, so a delayed rank gives its CPU away instead of burning it: on a machine
with fewer cores than workers the other ranks run faster meanwhile (``poise bench
stragglers`` says so next to its figures). Every draw comes from a generator seeded by
``(seed, rank, step, micro-batch)``, so a run's delays are the same whatever else runs, and
the delay-free run of the same seed differs only by them.

Each model is written ``NAME:key=value,...`` (``straggler.delay``); ``x`` is always a multiple
of the rank's own compute, so a delay scales with the work it interrupts:

- ``bernoulli:p=0.2,x=1``: with probability ``p`` per rank per step, the rank stalls for ``x``
  times its predicted compute of the whole step before its first micro-batch (``per=micro``:
  probability ``p`` per micro-batch, ``x`` times that micro-batch's compute, after it). Mean
  inflation ``p·x``.
- ``lognormal:mean=0.2,sigma=1``: after every micro-batch, a stall of ``X`` times its compute,
  ``X = mean·exp(σZ − σ²/2)`` with Z standard normal: mean-normalised, mean inflation ``mean``
  (the multiplicative latency DropCompute evaluates).
- ``pareto:mean=0.2,alpha=2.5``: ``X`` Pareto (Lomax) distributed with tail index ``alpha``,
  scaled to mean ``mean``: rare, very long stalls.
- ``slow:rank=1,x=0.2``: one persistent slow rank, every micro-batch stretched by ``1 + x``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

MODELS = ("bernoulli", "lognormal", "pareto", "slow")
_KEYS = {
    "bernoulli": {"p": 0.2, "x": 1.0, "per": "step"},
    "lognormal": {"mean": 0.2, "sigma": 1.0},
    "pareto": {"mean": 0.2, "alpha": 2.5},
    "slow": {"rank": 1, "x": 0.2},
}


@dataclass(frozen=True)
class DelayModel:
    """One parsed delay model (see module doc); ``name`` '' is no delay."""

    name: str = ""
    p: float = 0.0
    x: float = 0.0
    per: str = "step"
    mean: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    rank: int = -1
    seed: int = 0

    @classmethod
    def parse(cls, text: str, seed: int = 0) -> DelayModel:
        """``NAME:key=value,...`` (missing keys take the defaults of the module doc); '' or 'none': no delay.

        Raises:
            ValueError: one line naming the model or the key and what is allowed.
        """
        text = text.strip()
        if text in ("", "none"):
            return cls(seed=seed)
        name, _, rest = text.partition(":")
        if name not in _KEYS:
            raise ValueError(f"straggler.delay model {name!r} is unknown: allowed are {', '.join(MODELS)} "
                             "(e.g. 'bernoulli:p=0.2,x=1')")
        values: dict[str, object] = dict(_KEYS[name])
        for item in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in values:
                raise ValueError(f"straggler.delay {text!r}: {item!r} is not one of "
                                 f"{', '.join(f'{k}=' for k in values)}")
            default = values[key]
            try:
                values[key] = value if isinstance(default, str) else type(default)(value)
            except ValueError:
                raise ValueError(f"straggler.delay {text!r}: {key}={value!r} is not a number") from None
        model = cls(name=name, seed=seed, **values)  # type: ignore[arg-type]
        model._check(text)
        return model

    def _check(self, text: str) -> None:
        bad = None
        if self.name == "bernoulli" and not (0.0 <= self.p <= 1.0 and 0.0 <= self.x <= 100.0):
            bad = "p must be in [0, 1] and x in [0, 100]"
        elif self.name == "bernoulli" and self.per not in ("step", "micro"):
            bad = "per must be step or micro"
        elif self.name in ("lognormal", "pareto") and not 0.0 <= self.mean <= 100.0:
            bad = "mean must be in [0, 100]"
        elif self.name == "lognormal" and not 0.0 <= self.sigma <= 5.0:
            bad = "sigma must be in [0, 5]"
        elif self.name == "pareto" and not 1.0 < self.alpha <= 100.0:
            bad = "alpha must be in (1, 100] (a finite mean)"
        elif self.name == "slow" and not (self.rank >= 0 and 0.0 <= self.x <= 100.0):
            bad = "rank must be >= 0 and x in [0, 100]"
        if bad or any(isinstance(v, float) and not math.isfinite(v) for v in (self.p, self.x, self.mean,
                                                                               self.sigma, self.alpha)):
            raise ValueError(f"straggler.delay {text!r}: {bad or 'values must be finite'}")

    @property
    def enabled(self) -> bool:
        return bool(self.name)

    def mean_inflation(self) -> float:
        """Expected delay as a fraction of compute (0.2: a 20 % mean inflation)."""
        if self.name == "bernoulli":
            return self.p * self.x
        if self.name in ("lognormal", "pareto"):
            return self.mean
        return self.x if self.name == "slow" else 0.0

    def describe(self) -> str:
        """The model in words, with its mean inflation (for reports)."""
        if self.name == "bernoulli":
            where = ("per rank per step, before the step's first micro-batch, x times the step's predicted compute"
                     if self.per == "step" else "per rank per micro-batch, x times that micro-batch's compute")
            return f"bernoulli p={self.p:g} x={self.x:g} ({where}); mean inflation {self.mean_inflation():.0%}"
        if self.name == "lognormal":
            return (f"lognormal multiplier per micro-batch, mean {self.mean:g}, sigma {self.sigma:g} "
                    f"(stall = X x compute); mean inflation {self.mean_inflation():.0%}")
        if self.name == "pareto":
            return (f"pareto (lomax) multiplier per micro-batch, alpha {self.alpha:g}, mean {self.mean:g}; "
                    f"mean inflation {self.mean_inflation():.0%}")
        if self.name == "slow":
            return f"rank {self.rank} persistently slow: every micro-batch x{1 + self.x:g}"
        return "no delays"

    def _rng(self, rank: int, step: int, micro: int) -> np.random.Generator:
        return np.random.default_rng([self.seed, rank, step, micro + 1])

    def before_step(self, rank: int, step: int, step_compute_s: float | None) -> float:
        """Seconds to stall before the step's first micro-batch (per-step Bernoulli only);
        ``step_compute_s``: the rank's predicted compute of the step (None: not known yet, no stall)."""
        if self.name != "bernoulli" or self.per != "step" or step_compute_s is None:
            return 0.0
        hit = self._rng(rank, step, -1).random() < self.p
        return self.x * step_compute_s if hit else 0.0

    def after_micro(self, rank: int, step: int, micro: int, compute_s: float) -> float:
        """Seconds to stall after a micro-batch that computed for ``compute_s`` seconds."""
        if self.name == "slow":
            return self.x * compute_s if rank == self.rank else 0.0
        if self.name == "bernoulli":
            if self.per != "micro":
                return 0.0
            return self.x * compute_s if self._rng(rank, step, micro).random() < self.p else 0.0
        if self.name == "lognormal":
            z = self._rng(rank, step, micro).standard_normal()
            return compute_s * self.mean * math.exp(self.sigma * z - self.sigma**2 / 2)
        if self.name == "pareto":
            lomax = self._rng(rank, step, micro).pareto(self.alpha)  # mean 1 / (alpha - 1)
            return compute_s * self.mean * (self.alpha - 1) * lomax
        return 0.0


__all__ = ["MODELS", "DelayModel"]
