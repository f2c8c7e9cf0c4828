"""``[emulate]``: slowness and failures put into a run on purpose, for tests, benchmarks and
demos: slower ranks, noisy compute, injected delays, a slow input pipeline, a killed worker.

Nothing here changes what is trained; the settings only say what to emulate (installed around
a run by wrapping, see poise/emulate/). They were spread over other sections before and their
old keys stay accepted (:data:`FORMER_SECTIONS`): ``balance.rank_speed``, ``straggler.delay``,
``faults.fail_at``... are read into this section (``poise.config.from_dict``, the CLI's
flags). Error messages name each setting by that old key, which users and scripts know.

A delay model is written ``NAME:key=value,...``; ``x`` is always a multiple of the rank's own
compute, so a delay scales with the work it interrupts (the draws: ``poise/emulate/delays.py``):

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

from poise.config.fields import setting

# Where each setting of this section lived before it had one; those keys stay accepted.
FORMER_SECTIONS = {
    "rank_speed": "balance",
    "speed_noise": "balance",
    "speed_noise_steps": "balance",
    "slowdown_method": "balance",
    "delay": "straggler",
    "fail_at": "faults",
    "data_delay_s": "faults",
}
SLOWDOWN_METHODS = ("auto", "cgroup", "sleep")
# The slowest an emulated rank may be: 100 times slower. Below it a step would never end (the
# sleep method waits compute x (1/speed - 1)) and a CPU quota would be under a kernel tick.
MIN_RANK_SPEED = 0.01
DELAY_MODELS = ("bernoulli", "lognormal", "pareto", "slow")
# each model's keys with their defaults
_DELAY_KEYS: dict[str, dict[str, float | int | str]] = {
    "bernoulli": {"p": 0.2, "x": 1.0, "per": "step"},
    "lognormal": {"mean": 0.2, "sigma": 1.0},
    "pareto": {"mean": 0.2, "alpha": 2.5},
    "slow": {"rank": 1, "x": 0.2},
}


def _key(name: str) -> str:
    """The key that error messages name a setting of this section by (its former one)."""
    return f"{FORMER_SECTIONS[name]}.{name}"


@dataclass(frozen=True)
class DelaySpec:
    """One parsed delay model (see module doc); ``name`` '' is no delay. Units: ``p`` a
    probability, ``x``, ``mean`` multiples of compute, ``sigma`` and ``alpha`` shape parameters."""

    name: str = ""
    p: float = 0.0
    x: float = 0.0
    per: str = "step"
    mean: float = 0.0
    sigma: float = 0.0
    alpha: float = 0.0
    rank: int = -1

    @classmethod
    def parse(cls, text: str) -> DelaySpec:
        """``NAME:key=value,...`` (missing keys take the defaults of the module doc); '' or 'none': no delay.

        Raises:
            ValueError: one line naming the model or the key and what is allowed.
        """
        text = text.strip()
        if text in ("", "none"):
            return cls()
        name, _, rest = text.partition(":")
        if name not in _DELAY_KEYS:
            raise ValueError(f"straggler.delay model {name!r} is unknown: allowed are {', '.join(DELAY_MODELS)} "
                             "(e.g. 'bernoulli:p=0.2,x=1')")
        values = dict(_DELAY_KEYS[name])
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
        spec = cls(name=name, **values)  # type: ignore[arg-type]
        spec._check(text)
        return spec

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
        """Whether any delay is injected."""
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


@dataclass(frozen=True, kw_only=True)
class EmulateConfig:
    """What to emulate: slower or noisy ranks, injected delays, a slow input pipeline, a failure."""

    rank_speed: str = setting("", "emulated heterogeneity, RANK:SPEED[@STEP[-END]],... with SPEED in [0.01, 1], e.g. "
                              "'1:0.5', '1:0.5@80' (slowed from step 80 on) or '1:0.5@80-160' (and back to full "
                              "speed at step 160)")
    speed_noise: float = setting(0.0, "emulated noise: every rank's compute in every step is stretched by 1 + X, "
                                 "X exponential with this mean (sleeps; 0 = none)")
    speed_noise_steps: int = setting(1, "emulated noise: steps in a row that share one draw of X (bursts of "
                                     "contention; 1 = a fresh draw every step)")
    slowdown_method: str = setting("auto", "how rank_speed slows a rank: auto, cgroup (CPU quota), sleep")
    delay: str = setting("", "injected delays (sleeps): bernoulli:p=0.2,x=1[,per=micro] | lognormal:mean=0.2,sigma=1 "
                         "| pareto:mean=0.2,alpha=2.5 | slow:rank=1,x=0.2 ('' = none); works in every straggler mode")
    fail_at: str = setting(
        "", "RANK:STEP: that worker kills itself (SIGKILL) before that step, in the launcher's first attempt only"
    )
    data_delay_s: float = setting(
        0.0, "emulated slow input pipeline: every batch takes this many more seconds to load on every rank "
        "(sleeps in the DataLoader's collate; 0 = none)"
    )

    def __post_init__(self) -> None:
        for name in ("speed_noise", "data_delay_s"):
            value = getattr(self, name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_key(name)}={value!r} is invalid: it must be a finite number")
        if isinstance(self.speed_noise_steps, bool) or not self.speed_noise_steps > 0:
            raise ValueError(f"{_key('speed_noise_steps')}={self.speed_noise_steps!r} is invalid: "
                             "it must be a positive number")
        if self.slowdown_method not in SLOWDOWN_METHODS:
            raise ValueError(f"{_key('slowdown_method')}={self.slowdown_method!r} is unknown: allowed are "
                             f"{', '.join(SLOWDOWN_METHODS)}")
        if not 0.0 <= self.speed_noise <= 10.0:
            raise ValueError(f"{_key('speed_noise')}={self.speed_noise} is outside [0, 10]")
        if not 0.0 <= self.data_delay_s <= 60.0:
            raise ValueError(f"{_key('data_delay_s')}={self.data_delay_s} is outside [0, 60] seconds")
        self.rank_speeds()  # validates
        self.delay_spec()
        self.rank_step()

    def rank_speeds(self) -> dict[int, tuple[float, int, int | None]]:
        """``rank_speed`` parsed: rank -> (speed factor in (0, 1], 1 = full speed; the step it
        applies from, 0 = from the start; the step it ends at, back to full speed, or None)."""
        speeds: dict[int, tuple[float, int, int | None]] = {}
        for item in filter(None, (p.strip() for p in self.rank_speed.split(","))):
            rank, sep, rest = item.partition(":")
            speed, at, steps = rest.partition("@")
            start, dash, end = steps.partition("-")
            try:
                r, s, k = int(rank), float(speed), int(start) if at else 0
                until = int(end) if dash else None
            except ValueError:
                r, s, k, until = -1, float("nan"), 0, None
            if not sep or r < 0 or k < 0 or (until is not None and until <= k):
                raise ValueError(f"{_key('rank_speed')} item {item!r} is invalid: give RANK:SPEED, RANK:SPEED@STEP or "
                                 "RANK:SPEED@STEP-END (END after STEP), e.g. 1:0.5, 1:0.5@80 or 1:0.5@80-160")
            if not MIN_RANK_SPEED <= s <= 1.0:
                raise ValueError(f"{_key('rank_speed')}: speed {speed!r} of rank {r} is outside "
                                 f"[{MIN_RANK_SPEED:g}, 1] (1 = full speed)")
            speeds[r] = (s, k, until)
        return speeds

    def delay_spec(self) -> DelaySpec:
        """``delay`` parsed (no delay when it is empty)."""
        return DelaySpec.parse(self.delay)

    def rank_step(self) -> tuple[int, int] | None:
        """``fail_at`` parsed: ``(rank, step)``, or None when no failure is planned."""
        if not self.fail_at:
            return None
        rank, sep, step = self.fail_at.partition(":")
        if not sep or not all(t.strip().isascii() and t.strip().isdigit() for t in (rank, step)):
            raise ValueError(f"{_key('fail_at')}={self.fail_at!r} is invalid: give RANK:STEP, e.g. 1:30")
        return int(rank), int(step)
